import sys

from localserve.cli import main

sys.exit(main())
