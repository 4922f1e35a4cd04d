"""Moving KV pages between workers.

    wire.py       the versioned frame format: headers, encode/decode, sign/verify,
                  PageLayout (pure: no state)
    inbox.py      the receiver's acceptance state machine (Inbox): which reservation a
                  message may fill, when it lands, completes or fails
    transfer.py   one record per transfer: a reservation's Transfer (the connector
                  makes it, the inbox fills it, the worker's record holds it) and a
                  prefill export's Export (the connector and its sender share it)
    transports/   the byte movers, each imported only when chosen (registry.py):
      curve.py    CURVE keys of an endpoint (no sockets: services load it freely)
      channel.py  the control channel every transport shares: ZeroMQ headers, acks,
                  pairing, CURVE; page bytes left to a page mover
      zmq.py      ZeroMQ transport: the channel + frame pages (tcp/ipc, zero-copy)
      nccl.py     torch.distributed transport: the channel + point-to-point pages
                  (NCCL on GPU, gloo on CPU)
    plan.py       the transfer plan: made by the decode side, carried by the router as bytes
    connector.py  one interface, two sides: the planning side the engine thread calls
                  (DecodeConnector, PrefillConnector) over the byte side transports
                  implement (Receiver, Sender); KVConnector is one worker's
    registry.py   transports by name (--kv-connector zmq | zmq_ipc | gloo | nccl | none)
    stats.py      the transfer counters (KVTransferStats)

kvtransfer knows nothing about scheduling or deadlines: a transfer's record
(transfer.py) has phases but no deadline, the planning side reports what arrived,
was acknowledged or failed, and never calls the engine; the worker's request table
(services/worker/requests.py) holds each record, decides and frees.
"""
