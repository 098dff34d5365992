"""`python -m rabbit_delay`: the `rabbit-delay` command line, for an environment
without the console script on PATH."""

from rabbit_delay._cli.app import main

if __name__ == "__main__":
    main()
