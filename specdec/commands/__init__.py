"""The ``specdec`` command: dispatch (``cli``) and ``specdec generate`` (``generate``); the
flags its subcommands share are in ``specdec.flags``."""
