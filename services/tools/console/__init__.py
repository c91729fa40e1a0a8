"""The `flightdeck` command line: one module per verb, registered in __main__.VERBS."""
