"""The launcher's half of the node agent: what it asks of the data plane around a generation.

    prefetch.py  prefetch on join: tell the hosted agent which ranks this node runs, before they start
    persist.py   persist on the way out: the newest committed memory step without a durable copy
"""
