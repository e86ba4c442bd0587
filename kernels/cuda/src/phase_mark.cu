// Empty kernels whose names mark where a phase of GPU work begins, for a profiler that lists
// launches in order (ncu's per-launch log): each launch after `xd_phase_NAME` and before the next
// mark belongs to phase NAME (`bench/ncu_kernels.py --phases`); `xd_phase_none` marks work outside
// any phase. Launched by `xdistill_shared::profiling` only when XDISTILL_PHASE_MARKS=1.

#define MARK(NAME) \
    extern "C" __global__ void xd_phase_##NAME() {}

MARK(none)
MARK(forward)
MARK(head_loss)
MARK(backward)
MARK(accumulate)
MARK(clip)
MARK(optimizer)
MARK(collective)
MARK(head)
MARK(topk)
MARK(copy)
