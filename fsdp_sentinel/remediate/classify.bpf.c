// The remediator's classifier: one cls_bpf program, direct action, on the
// remediator's own HTB qdisc (never on clsact: others' programs stay as
// they are). A packet whose TCP 4-tuple is in job_flows goes to the job's
// class, anything else to the other class; the daemon updates the map as the
// job's flows come and go, so reprioritising is a map update, not filter
// churn. JOB_CLASSID and OTHER_CLASSID (major:minor of the HTB classes) are
// set at load time by fsdp_sentinel/remediate/classifier.py.
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>

// Network byte order, as the packet carries them; the loader fills keys the
// same way (fsdp_sentinel/remediate/classifier.py: FlowKey).
struct flow_key {
    u32 saddr;
    u32 daddr;
    u16 sport;
    u16 dport;
};

BPF_HASH(job_flows, struct flow_key, u8, 16384);
// Bytes classified into [0] the job's class and [1] the other one.
BPF_ARRAY(class_bytes, u64, 2);

int fss_classify(struct __sk_buff *skb)
{
    u32 slot = 1;
    u32 classid = OTHER_CLASSID;
    struct flow_key key = {};
    u8 vihl = 0, proto = 0;

    if (skb->protocol != bpf_htons(ETH_P_IP))
        goto out;
    // Offsets from the Ethernet header (tc egress sees the frame).
    if (bpf_skb_load_bytes(skb, ETH_HLEN, &vihl, 1) < 0)
        goto out;
    if (bpf_skb_load_bytes(skb, ETH_HLEN + 9, &proto, 1) < 0 || proto != IPPROTO_TCP)
        goto out;
    if (bpf_skb_load_bytes(skb, ETH_HLEN + 12, &key.saddr, 8) < 0)
        goto out;  // saddr and daddr are adjacent in the IP header
    u32 l4 = ETH_HLEN + ((u32)(vihl & 0x0f) << 2);
    if (bpf_skb_load_bytes(skb, l4, &key.sport, 4) < 0)
        goto out;  // source and dest ports are adjacent in the TCP header
    if (job_flows.lookup(&key)) {
        classid = JOB_CLASSID;
        slot = 0;
    }
out:;
    u64 *bytes = class_bytes.lookup(&slot);
    if (bytes)
        __sync_fetch_and_add(bytes, skb->len);
    skb->tc_classid = classid;
    return TC_ACT_OK;
}
