// Packet loss for the lab: this kernel has cls_bpf but no netem.
// A direct-action classifier on clsact egress: drop each packet with
// probability DROP_THRESH / 2^32 (DROP_THRESH is set at load time by
// fsdp_sentinel/lab/loss.py). Drops show in the clsact qdisc's counters.
#include <uapi/linux/pkt_cls.h>

int fss_drop(struct __sk_buff *skb)
{
    if ((u64)bpf_get_prandom_u32() < DROP_THRESH)
        return TC_ACT_SHOT;
    return TC_ACT_OK;
}
