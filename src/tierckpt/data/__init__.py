"""The data pipeline's position, checkpointed with the model: a resumed run sees the batches a
fault-free run would have seen.

    loader = tierckpt.data.ResumableLoader(dataset, batch_size=32, seed=0, num_workers=4)  # or a StatefulDataLoader
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "data": tierckpt.data.item(loader)}
    start = ck.load(state)                # the loader continues after the last batch step `start` consumed

After a process restart, ``loader = tierckpt.data.ahead(make_loader)`` takes the loader a warm
standby built and started before the fault (``tierckpt run --warm-loader MOD:make_loader``;
``tierckpt.data.prewarm``), or builds one.

``order`` (``EpochOrder``, ``ResumableSampler``): DistributedSampler's order of each epoch and
the resharding rule; ``loader`` (``ResumableLoader``): a plain ``DataLoader`` that counts the
batches the loop consumed (not those its workers prefetched); ``state`` (``item``,
``loader_state``, ``restore_loader``): one checkpoint item per rank, for ``ResumableLoader`` and
torchdata's ``StatefulDataLoader``. Details, limits and the resharding rule: ``docs/data.md``.
"""

from tierckpt.data.loader import ResumableLoader
from tierckpt.data.order import EpochOrder, ResumableSampler
from tierckpt.data.prewarm import ahead
from tierckpt.data.state import LoaderItem, StatefulLoader, item, loader_state, restore_loader

__all__ = [
    "ahead",
    "EpochOrder",
    "LoaderItem",
    "ResumableLoader",
    "ResumableSampler",
    "StatefulLoader",
    "item",
    "loader_state",
    "restore_loader",
]
