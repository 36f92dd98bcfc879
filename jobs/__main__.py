"""`python -m jobs` runs the eaglebatch command line."""

from jobs.launch import main

main()
