"""The ITL benchmark harness (`specdec bench`): methods x padded/ragged x K x concurrency."""
