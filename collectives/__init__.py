"""What the graph ops autopar inserts run, beneath every other layer: every collective and P2P
call (comms.py) and the dropless MoE exchange (moe_exchange.py). Pure torch: no autopar import."""
