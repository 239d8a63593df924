"""One module per subcommand: glue between the CLI and the layers below."""
