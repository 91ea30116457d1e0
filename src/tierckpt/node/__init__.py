"""The node contract between a rank and its node agent: the node socket (``sock``), the node
budget (``budget``) and the steps kept for replicas (``keep``). Imports only the foundations."""
