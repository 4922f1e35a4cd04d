"""KV transports: the byte side of kvtransfer (connector.py's Sender / Receiver).

    curve.py    CURVE keys (no sockets)
    channel.py  the ZeroMQ control channel every transport shares
    zmq.py      ZeroMQ: page runs as frames
    nccl.py     torch.distributed (NCCL, gloo): page runs as point-to-point tensors

Chosen by name through kvtransfer/registry.py, which imports a transport's module
only when it is chosen; nothing here imports one eagerly.
"""
