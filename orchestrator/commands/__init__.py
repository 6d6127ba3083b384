"""The ``hotspare`` subcommands, one module per area; :mod:`hotspare.orchestrator.cli` is the entry point.

* :mod:`.common` -- where etcd is, connecting to it, the user-facing error, the declaration
  of a subcommand (:class:`~.common.Command`).
* :mod:`.jobs` -- submit, run, wait, cancel.
* :mod:`.observe` -- status, events, logs.
* :mod:`.checkpoint` -- persist a job's state out of schedule.
* :mod:`.chaos` -- inject failures.
* :mod:`.cluster` -- the processes a cluster runs: embedded up/down, agent, controller, etcd.

Each module lists its subcommands in ``COMMANDS``, with their flags beside their code.
Nothing here imports torch: ``hotspare --help`` loads every module.
"""
