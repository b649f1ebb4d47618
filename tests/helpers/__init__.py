"""What the tests share: paths, tiny models, run builders and report rows, each defined once."""
