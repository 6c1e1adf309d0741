"""``python -m fedapp.cli``: the ``fedsched`` command line."""

from fedapp.cli.root import main

main()
