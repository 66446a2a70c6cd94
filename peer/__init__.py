"""The volunteer server: loads the blocks it serves, runs sessions for clients, announces itself."""
