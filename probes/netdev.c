/* netdev.c: bytes and packets per network device name, from net:net_dev_xmit
 * (sent, skb->len at the driver, link-layer header included) and
 * net:netif_receive_skb (received, skb->len after the driver pulled the
 * link-layer header; user space adds it back, see docs/probes.md).
 * Device names carry no namespace: give interfaces machine-wide unique names. */

BPF_TABLE("lru_hash", struct dev_key, struct dev_counters, devs, SENTINEL_MAX_DEVS);

static __always_inline struct dev_counters *dev_slot(void *args, u32 loc)
{
    struct dev_key k = {};
    /* __data_loc: low 16 bits = offset of the string in the record */
    bpf_probe_read_kernel_str(k.name, sizeof(k.name), (char *)args + (loc & 0xFFFF));
    struct dev_counters *c = devs.lookup(&k);
    if (c)
        return c;
    struct dev_counters zero = {};
    if (devs.insert(&k, &zero) == 0)
        stat_add(SENTINEL_STAT_DEV_NEW, 1);
    return devs.lookup(&k);
}

#ifdef SENTINEL_HAVE_net__net_dev_xmit
TRACEPOINT_PROBE(net, net_dev_xmit)
{
    struct dev_counters *c = dev_slot(args, args->data_loc_name);
    if (!c)
        return 0;
    if (args->rc != 0) {
        __sync_fetch_and_add(&c->tx_errors, 1);
        return 0;
    }
    __sync_fetch_and_add(&c->tx_bytes, (u64)args->len);
    __sync_fetch_and_add(&c->tx_packets, 1);
    return 0;
}
#endif

#ifdef SENTINEL_HAVE_net__netif_receive_skb
TRACEPOINT_PROBE(net, netif_receive_skb)
{
    struct dev_counters *c = dev_slot(args, args->data_loc_name);
    if (!c)
        return 0;
    __sync_fetch_and_add(&c->rx_bytes, (u64)args->len);
    __sync_fetch_and_add(&c->rx_packets, 1);
    return 0;
}
#endif
