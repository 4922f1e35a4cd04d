"""Moving KV pages from prefill workers to decode workers.

    wire.py       the versioned frame format and the receiver's acceptance rules
    curve.py      CURVE keys of an endpoint (no sockets: services load it freely)
    channel.py    the control channel every transport shares: ZeroMQ headers, acks,
                  pairing, CURVE; page bytes left to a page mover
    zmq.py        ZeroMQ transport: the channel + frame pages (tcp/ipc, zero-copy)
    nccl.py       torch.distributed transport: the channel + point-to-point pages
                  (NCCL on GPU, gloo on CPU)
    connector.py  prefill side (stream pages layer by layer, release on ack or lease)
                  and decode side (reserve, receive, commit or abort on deadline)

kvtransfer knows nothing about scheduling: the connectors drive an engine through
its public disaggregation API and never touch its internals.
"""
