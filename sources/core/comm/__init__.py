"""Collectives that never wait forever: bounded waits and the failure board (``waits``), the
point-to-point "gather to one rank" mover (``p2p``), who sends each tensor (``senders``).
May import ``core.ground`` only."""
