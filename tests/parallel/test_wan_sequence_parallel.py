"""Wan (full 3D attention) under sequence parallelism, trained by the Trainer under torchrun
(gloo, CPU): Ulysses, ring attention and both combined (USP) match one process. The layouts
themselves are tested on a stand-in model in ``test_full_attention_sp.py``; this runs them
through ``parallelize`` on the real family, its spec's ``sequence_args`` and its blocks."""

from test_distributed import assert_matches, base, run_layouts, single_process

WAN = {"model.preset": "wan-tiny", "model.depth": 2}


def test_wan_sequence_parallel_layouts_match_one_process(toy_dir, tmp_path):
    video = base(toy_dir, **WAN)
    got = run_layouts(toy_dir, tmp_path, 4, {
        "ulysses": video + ["parallel.sp=2", "parallel.dp_shard=1", "parallel.dp_replicate=2"],
        "ring": video + ["parallel.sp=2", "parallel.sp_ring=2", "parallel.dp_shard=2"],
        "usp": video + ["parallel.sp=4", "parallel.sp_ring=2"],
    })
    accum2 = single_process(video + ["train.grad_accum=2"], tmp_path / "ref2")
    assert_matches(got["ulysses"], accum2)
    assert_matches(got["ring"], accum2)
    assert_matches(got["usp"], single_process(video, tmp_path / "ref1"))
