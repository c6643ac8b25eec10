"""Where the engine's vectors live and how the model computes with them: one process (``single``) or this rank of an
FSDP2 model (``fsdp``), behind one protocol (``base``)."""
