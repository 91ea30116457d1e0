"""The ``tierckpt`` subcommands, one module each: ``HELP``, ``add_arguments(parser)``, ``main(args)``.

``tierckpt.cli`` registers them (its ``COMMANDS`` table) and turns a ``TierckptError`` into
the exit code. Storage commands: ``ls``, ``show``, ``verify``, ``promote``, ``export``, ``gc``
(``context`` holds what they share, ``progress`` their progress output); ``demo`` and
``bench`` start the demo and the benchmarks.
"""
