"""The ``specdec`` command: dispatch (``cli``), the flags its subcommands share (``flags``) and
``specdec generate`` (``generate``)."""
