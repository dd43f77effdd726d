"""What several test modules share: tiny models, a real server process, reference attention, key files."""
