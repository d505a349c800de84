"""Checkpoints: everything needed to continue a run bit for bit, written atomically, in one format
for every number of processes.

A checkpoint is a folder runs/<name>/checkpoints/step_NNNNNNN/ holding
    model/                  weights by parameter name (tied tensors stored once)    } torch.distributed.checkpoint
    optimizer/              optimizer state by parameter name: `<name>.exp_avg`, ... } folders: .metadata + a
                                                                                      __<rank>_0.distcp per rank
    rng.safetensors         random generator states (CPU, and CUDA where used; every rank runs the same)
    state.json              step, data-loader position, optimizer hyper-parameters, metrics so far,
                            the number of ranks and the per-rank batch it was written with
    config.yaml, tokenizer.json   as the trainer holds them in memory
    manifest.json           size and sha256 of every file above, written last

    tensors.py   one torch.distributed.checkpoint folder: tensors by name, in and out
    write.py     `save_checkpoint`: staged, sealed with its manifest, renamed into place, pruned
    find.py      `list_checkpoints`, `find_checkpoint` (the newest one that matches its manifest)
    read.py      model weights, optimizer state and RNG back, by parameter name

It is written to a hidden '.partial' folder (every rank writes its part with `dcp.save`, rank 0 the
rest), synced to disk, and after a barrier rank 0 writes the manifest and renames the folder into
place: a kill at any moment leaves the previous checkpoints whole, and a folder named step_NNNNNNN is
always complete. A model or optimizer state holding inf or NaN is refused before anything is
written, and a save that fails (a full disk, on any rank) removes its '.partial' and names the
checkpoint that is kept. Resuming takes the newest checkpoint whose files match their manifest,
reporting any newer one that does not (a disk error, a bad copy) instead of failing outright.

State is keyed by parameter name, as torch.distributed.checkpoint keys it (`get_model_state_dict`,
`get_optimizer_state_dict`; wrapper segments such as recomputation's are left out of the names),
not by position, and each tensor is stored whole in the checkpoint's logical view: a run saved by
N processes loads on M (one included: `dcp` needs no process group), a model with parameters
added (adapters) or removed can load what matches, and a parameter that moved in the optimizer's
order still gets its own state. Loading into a model whose names differ is an explicit choice
(`strict=False`) and lists the names.
"""
