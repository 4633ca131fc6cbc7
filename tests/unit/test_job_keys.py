"""A job's Redis keys and their hash tags (tidegate/keys.py): on a Redis Cluster its
stream, lease, cancel key and channel must share one slot (the lease-checked append
script reads two of them), and the tags must spread over the slot space evenly."""

from __future__ import annotations

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from tidegate import keys

NS = "tidegate"


def test_a_job_s_keys_share_one_slot_and_its_tag() -> None:
    for job_id in ("3f2b1e7a-0c1d-4e5f-9a8b-7c6d5e4f3a2b", "job-1", "x"):
        slots = {key_slot(k.encode()) for k in (
            keys.job_events(NS, job_id), keys.job_lease(NS, job_id),
            keys.job_cancel(NS, job_id), keys.job_live(NS, job_id))}
        assert len(slots) == 1
        assert keys.tag_of(keys.job_events(NS, job_id)) == keys.job_tag(job_id)


def test_tags_sit_at_the_centre_of_equal_shares_of_the_slots() -> None:
    """So masters that split the slots evenly (redis-cli --cluster create) get the same
    number of tags each: 2, 3, 4, 6, 8, 12 or 24 of them."""
    share = REDIS_CLUSTER_HASH_SLOTS / len(keys.JOB_TAGS)
    slots = [key_slot(f"{{{tag}}}".encode()) for tag in keys.JOB_TAGS]
    assert all(abs(slot - (i + 0.5) * share) < 1 for i, slot in enumerate(slots))
    for masters in (2, 3, 4, 6, 8, 12):
        counts = [0] * masters
        for slot in slots:  # the ranges redis-cli gives: 16384 / masters, rounded
            counts[min(int(slot * masters / REDIS_CLUSTER_HASH_SLOTS), masters - 1)] += 1
        assert len(set(counts)) == 1, (masters, counts)


def test_a_job_s_tag_is_the_same_in_every_process_and_release() -> None:
    """Pinned: a changed tag moves every running job's keys (its stream, its lease)."""
    assert keys.job_tag("3f2b1e7a-0c1d-4e5f-9a8b-7c6d5e4f3a2b") == "t40483"
    assert keys.job_events(NS, "job-1") == "tidegate:job:{t6980}:job-1:events"
    spread = {keys.job_tag(f"job-{i}") for i in range(1000)}
    assert spread == set(keys.JOB_TAGS)
