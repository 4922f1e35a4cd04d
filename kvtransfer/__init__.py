"""Moving KV pages from prefill workers to decode workers.

    wire.py       the versioned frame format and the receiver's acceptance rules
    zmq.py        ZeroMQ transport (tcp/ipc, zero-copy frames, optional CURVE)
    nccl.py       torch.distributed point-to-point transport (NCCL on GPU, gloo on CPU)
    connector.py  prefill side (stream pages layer by layer, release on ack or lease)
                  and decode side (reserve, receive, commit or abort on deadline)

kvtransfer knows nothing about scheduling: the connectors drive an engine through
its public disaggregation API and never touch its internals.
"""
