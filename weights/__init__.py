"""Weight transports: how the trainer's new weights reach the samplers, one module per transport, each holding
both sides (the trainer's publisher, a sampler's receiver), registered by name in registry.py.

* shm.py       ``shm``: a safetensors file in /dev/shm (one machine; the default)
* stream.py    ``stream``: the same file in chunks over ZeroMQ (no shared file system)
* delta.py     ``delta``: only the elements that changed since the version before, over the stream's ROUTER
* nccl.py      ``nccl``: a torch.distributed broadcast to the samplers that ask (NCCL on CUDA, else gloo);
               its receiver in nccl_receiver.py
* cuda_ipc.py  ``cuda_ipc``: the trainer's GPU buffer, mapped by samplers on its GPU (no file)
* registry.py  ``TRANSPORTS`` (name -> publisher), ``RECEIVERS``, and a sampler's ``load(engine, notice, run_id)``
* layout.py    the safetensors layout every transport publishes, and the pinned staging of device tensors
* common.py    the run's weights folder, ``WeightsError``/``TornRead``, the checksum (no torch: the supervisor
               imports it)
* notices.py   the trainer's weights PUB on its own IO thread (``NoticePublisher``)

This file imports nothing, so that ``common`` stays light; import the module you need.
"""
