"""`python -m jobs` runs the eaglebatch command line."""

from jobs.cli import main

main()
