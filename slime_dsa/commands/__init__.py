"""CLI subcommands of the core package (each: add_parser(subparsers) + run(args), heavy imports inside run)."""
