"""`python -m harness.cli`: the `bench` command."""

from harness.cli import main

main()
