# The compiler's own progress ("[120/380] Building ...") shown as one line every 20 steps,
# and its errors; used by scripts/setup and scripts/build-libllama.
/^ *\[[0-9]+\/[0-9]+\]/ { split($1, p, /[\[\/\]]/); if (p[2] % 20 == 0 || p[2] == p[3])
                          { printf "[setup] compiling llama.cpp: %d of %d steps\n", p[2], p[3]; fflush() } }
/error:|Error:|FAILED:/ { print; fflush() }
