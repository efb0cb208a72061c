"""The ``kvsieve`` command. Each module here that defines ``register(subparsers)`` adds a subcommand."""
