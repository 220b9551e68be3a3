"""PromptDataModule's sampler: accumulation windows served once per micro-batch, full windows only, exact resume."""

from __future__ import annotations

import pytest

from esrl.data import PromptSampler


def _served(sampler: PromptSampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize(("n", "replicas", "size", "repeats"), [(10, 1, 4, 2), (10, 1, 3, 3), (11, 2, 2, 2),
                                                               (7, 1, 2, 1)])
def test_windows_are_served_once_per_micro_batch_and_only_full(n, replicas, size, repeats):
    """Each window of `size` indices of the epoch's permutation is served `repeats` times in a row; a last window
    that is not full is left out, as TRL's RepeatSampler leaves it (with repeats 1 too: 7 prompts, 2 a step, served
    3 steps of 2, where a fourth ES iteration scored its members on 1 prompt)."""
    for rank in range(replicas):
        plain = PromptSampler(n, shuffle=True, seed=5, num_replicas=replicas, rank=rank)
        windowed = PromptSampler(n, shuffle=True, seed=5, num_replicas=replicas, rank=rank, window_size=size,
                                 window_repeats=repeats)
        for epoch in (0, 1):
            permutation, served = _served(plain, epoch), _served(windowed, epoch)
            assert len(served) == len(windowed)
            full = len(permutation) // size
            assert len(served) == full * size * repeats
            for w in range(full):
                window = permutation[w * size:(w + 1) * size]
                assert served[w * size * repeats:(w + 1) * size * repeats] == window * repeats
    assert _served(windowed, 0) != _served(windowed, 1)  # each epoch reshuffles


def test_resume_continues_the_same_windows():
    """A resume at batch b (a micro-batch of a window) serves exactly what the uninterrupted epoch served after it."""
    size, repeats = 3, 2
    whole = _served(PromptSampler(12, True, 9, window_size=size, window_repeats=repeats), 1)
    for batches in range(len(whole) // size):
        resumed = PromptSampler(12, True, 9, window_size=size, window_repeats=repeats)
        resumed.resume_at = (1, batches * size)
        assert _served(resumed, 1) == whole[batches * size:]


def test_a_task_without_evaluation_rows_says_its_evaluations_score_the_training_prompts():
    from esrl.data import PromptDataModule

    with pytest.warns(UserWarning, match="data.task 'countdown' has no evaluation rows .* score the training prompts"):
        data = PromptDataModule("countdown", {"num_train": 8, "num_eval": 0})
    assert [r for b in data.eval_dataloader() for r in b["rows"]] == data.task.train_rows


def test_a_position_saved_over_other_processes_or_micro_batches_is_refused_in_one_line():
    """GRPO shards the prompts over its processes and counts each process's batches: a checkpoint 1 batch into its
    epoch on 2 processes, resumed on 1, skipped half the prompts left in that epoch (each rank replayed the count
    against its new shard). Refused, naming both layouts; a position at an epoch's start, or an older checkpoint
    without its layout, resumes as before."""
    import lightning as L

    from esrl.data import PromptDataModule
    from esrl.errors import ConfigError

    def loader(state):
        data = PromptDataModule("countdown", {"num_train": 8, "num_eval": 2}, prompts_per_step=2)
        data.trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        data.load_state_dict(state)
        return data.train_dataloader()

    with pytest.raises(ConfigError, match=r"^--ckpt_path: saved 1 batches into its epoch with the prompts over 2 "
                                          r"processes and trainer.accumulate_grad_batches 1; resumed with 1 and 1"):
        loader({"epoch": 0, "batches": 1, "replicas": 2, "micro_batches": 1})
    for fine in ({"epoch": 1, "batches": 0, "replicas": 2, "micro_batches": 1}, {"epoch": 0, "batches": 1},
                 {"epoch": 0, "batches": 1, "replicas": 1, "micro_batches": 1}):
        assert loader(fine) is not None
