"""One module per `kvscope` subcommand; see engine/cli.py."""
