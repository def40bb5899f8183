"""pdxfer-probe: bandwidth/latency probe for pdxfer transports (see ``cli.py``)."""
