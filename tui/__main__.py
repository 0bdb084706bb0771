import sys

from tui.app import main

sys.exit(main())
