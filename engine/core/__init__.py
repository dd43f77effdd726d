"""The engine-core process: `EngineCore.step` over the scheduler and the model executor, requests, start-up and
KV sizing, the process loop behind the IPC sockets, and the tensor-parallel workers."""
