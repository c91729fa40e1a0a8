"""The one typed catalog of Flightdeck events and commands, plus their codec, subjects and stores."""
