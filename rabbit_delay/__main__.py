"""`python -m rabbit_delay`: the `rabbit-delay` command line, for an environment
without the console script on PATH."""

from rabbit_delay.cli import main

if __name__ == "__main__":
    main()
