#!/usr/bin/env python3
"""Writes the hand-made seed inputs of the cargo-fuzz corpora (fuzz/corpus/<target>/seed_*).

Valid inputs of each parser: real packets (checksums right) from the first
client's tunnel IP 100.96.0.2, real DNS queries and answers, SSH configs,
known_hosts lines, kube-apiserver flags, kubeconfigs and prost-encoded manager
messages. Sequences use the `chunks` shape of kvpn_proto::fuzzing: a 2-byte
big-endian length before each part. Run from anywhere: `python3 fuzz/seeds.py`.
Files the fuzzer added (named by their hash) are kept.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
LAPTOP4 = bytes([100, 96, 0, 2])
POD4 = bytes([10, 244, 1, 11])
SVC4 = bytes([10, 96, 0, 101])
LAPTOP6 = bytes.fromhex("fd00006400000000000000000000" + "0002")
POD6 = bytes.fromhex("fd00000a024400010000000000000011")


def csum(data):
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack("!%dH" % (len(data) // 2), data))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return (~s) & 0xFFFF


def ipv4(src, dst, proto, payload, ident=1, flags_off=0x4000, ttl=64):
    hdr = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), ident, flags_off, ttl, proto, 0, src, dst)
    hdr = hdr[:10] + struct.pack("!H", csum(hdr)) + hdr[12:]
    return hdr + payload


def ipv6(src, dst, nh, payload, hop=64):
    return struct.pack("!IHBB16s16s", 6 << 28, len(payload), nh, hop, src, dst) + payload


def l4_csum(src, dst, proto, seg):
    if len(src) == 4:
        pseudo = src + dst + struct.pack("!BBH", 0, proto, len(seg))
    else:
        pseudo = src + dst + struct.pack("!IxxxB", len(seg), proto)
    return csum(pseudo + seg)


def tcp(src, dst, sport, dport, seq, ack, flags, data=b"", opts=b""):
    off = (20 + len(opts)) // 4
    seg = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, off << 4, flags, 65535, 0, 0) + opts + data
    c = l4_csum(src, dst, 6, seg)
    return seg[:16] + struct.pack("!H", c) + seg[18:]


def udp(src, dst, sport, dport, data):
    seg = struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data
    c = l4_csum(src, dst, 17, seg) or 0xFFFF
    return seg[:6] + struct.pack("!H", c) + seg[8:]


def icmp4_echo(ident, seq, data):
    m = struct.pack("!BBHHH", 8, 0, 0, ident, seq) + data
    return m[:2] + struct.pack("!H", csum(m)) + m[4:]


def icmp6_echo(src, dst, ident, seq, data):
    m = struct.pack("!BBHHH", 128, 0, 0, ident, seq) + data
    c = l4_csum(src, dst, 58, m)
    return m[:2] + struct.pack("!H", c) + m[4:]


SYN, ACK, FIN, RST, PSH = 0x02, 0x10, 0x01, 0x04, 0x08
MSS = struct.pack("!BBH", 2, 4, 1460)


def t4(flags, seq, ack=0, data=b"", dst=POD4, dport=8080, opts=b""):
    return ipv4(LAPTOP4, dst, 6, tcp(LAPTOP4, dst, 40000, dport, seq, ack, flags, data, opts))


def t6(flags, seq, ack=0, data=b"", opts=b""):
    return ipv6(LAPTOP6, POD6, 6, tcp(LAPTOP6, POD6, 40000, 8080, seq, ack, flags, data, opts))


def u4(data, dst=POD4, dport=7007):
    return ipv4(LAPTOP4, dst, 17, udp(LAPTOP4, dst, 40001, dport, data))


def u6(data):
    return ipv6(LAPTOP6, POD6, 17, udp(LAPTOP6, POD6, 40001, 7007, data))


def ping4(seq, data=b"abcdefgh"):
    return ipv4(LAPTOP4, POD4, 1, icmp4_echo(0x1234, seq, data))


def ping6(seq, data=b"abcdefgh"):
    return ipv6(LAPTOP6, POD6, 58, icmp6_echo(LAPTOP6, POD6, 0x1234, seq, data))


def frags4(payload_l4, proto, size, ident=7):
    """IPv4 fragments of an L4 payload, each carrying `size` bytes (multiple of 8)."""
    out = []
    for off in range(0, len(payload_l4), size):
        part = payload_l4[off:off + size]
        mf = 0x2000 if off + size < len(payload_l4) else 0
        out.append(ipv4(LAPTOP4, POD4, proto, part, ident=ident, flags_off=mf | (off // 8)))
    return out


def frags6(payload_l4, nh, size, ident=9):
    out = []
    for off in range(0, len(payload_l4), size):
        part = payload_l4[off:off + size]
        m = 1 if off + size < len(payload_l4) else 0
        fh = struct.pack("!BBHI", nh, 0, (off // 8) << 3 | m, ident)
        out.append(ipv6(LAPTOP6, POD6, 44, fh + part))
    return out


def chunks(parts):
    return b"".join(struct.pack("!H", len(p)) + p for p in parts)


# ---- DNS -------------------------------------------------------------------

def dns_name(name):
    out = b""
    for label in name.strip(".").split("."):
        if label:
            out += bytes([len(label)]) + label.encode()
    return out + b"\0"


TYPES = {"A": 1, "NS": 2, "CNAME": 5, "SOA": 6, "PTR": 12, "MX": 15, "TXT": 16, "AAAA": 28, "SRV": 33, "ANY": 255}


def opt_rr(size=1232, options=b""):
    return b"\0" + struct.pack("!HHIH", 41, size, 0, len(options)) + options


def dns_query(name, qtype="A", qid=0x1234, edns=None, flags=0x0100, qdcount=1, extra=b""):
    arcount = 1 if edns is not None else 0
    hdr = struct.pack("!HHHHHH", qid, flags, qdcount, 0, 0, arcount)
    q = dns_name(name) + struct.pack("!HH", TYPES[qtype], 1)
    return hdr + q * qdcount + (opt_rr(edns) if edns is not None else b"") + extra


def rr(name_ptr, rtype, ttl, rdata):
    return name_ptr + struct.pack("!HHIH", TYPES[rtype], 1, ttl, len(rdata)) + rdata


def dns_answer(query, rcode=0, answers=(), authority=(), additional=(), tc=False):
    qid, flags, qd = struct.unpack("!HHH", query[:6])
    flags = 0x8000 | (flags & 0x0100) | 0x0080 | rcode | (0x0200 if tc else 0)
    # Question section of the query: everything after the header up to its OPT.
    q_end = 12
    while query[q_end] != 0:
        q_end += query[q_end] + 1
    q_end += 5
    hdr = struct.pack("!HHHHHH", qid, flags, qd, len(answers), len(authority), len(additional))
    return hdr + query[12:q_end] + b"".join(answers) + b"".join(authority) + b"".join(additional)


PTR0 = b"\xc0\x0c"
SOA = dns_name("cluster.local") + dns_name("hostmaster.cluster.local") + struct.pack("!IIIII", 1, 7200, 1800, 86400, 5)


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed_" + name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def pb_str(field, s):
    b = s.encode() if isinstance(s, str) else s
    return bytes([field << 3 | 2]) + varint(len(b)) + b


def pb_msg(field, m):
    return bytes([field << 3 | 2]) + varint(len(m)) + m


def pb_varint(field, v):
    return bytes([field << 3]) + varint(v)


def varint(v):
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def hello(ip, token, version=1):
    fam = b"\x04" if len(ip) == 4 else b"\x06"
    return struct.pack("!H", version) + fam + ip + bytes([len(token)]) + token


def main():
    # packet_parse: one packet each.
    big = u4(b"x" * 1400)
    pk = {
        "tcp_syn_v4": t4(SYN, 1000, opts=MSS),
        "tcp_ack_v4": t4(ACK, 1001, 5000),
        "tcp_data_v4": t4(ACK | PSH, 1001, 5000, b"GET / HTTP/1.1\r\nHost: web\r\n\r\n"),
        "tcp_fin_v4": t4(FIN | ACK, 1030, 5000),
        "tcp_rst_v4": t4(RST, 1030),
        "tcp_syn_clusterip": t4(SYN, 1, dst=SVC4, dport=7, opts=MSS),
        "tcp_syn_v6": t6(SYN, 2000, opts=MSS),
        "tcp_data_v6": t6(ACK | PSH, 2001, 9, b"hello"),
        "udp_v4": u4(b"ping"),
        "udp_dns_v4": u4(dns_query("web.dev.svc.cluster.local"), dst=bytes([10, 96, 0, 10]), dport=53),
        "udp_v6": u6(b"ping6"),
        "udp_big_v4": big,
        "icmp_echo_v4": ping4(1),
        "icmp_echo_v6": ping6(1),
        "frag_first_v4": frags4(udp(LAPTOP4, POD4, 40001, 7007, b"y" * 64), 17, 32)[0],
        "frag_first_v6": frags6(udp(LAPTOP6, POD6, 40001, 7007, b"y" * 64), 17, 32)[0],
        "bad_source_v4": ipv4(bytes([10, 0, 0, 9]), POD4, 17, udp(bytes([10, 0, 0, 9]), POD4, 1, 2, b"z")),
        "ttl1_v4": ipv4(LAPTOP4, POD4, 17, udp(LAPTOP4, POD4, 40001, 7007, b"t"), ttl=1),
        "short_v4": t4(SYN, 1)[:24],
        "igmp_v4": ipv4(LAPTOP4, POD4, 2, b"\x11\x00\xee\xff\x00\x00\x00\x00"),
        "icmp_reply_v4": ipv4(LAPTOP4, POD4, 1, b"\x00\x00\xff\xff\x00\x01\x00\x01"),
    }
    for k, v in pk.items():
        write("packet_parse", k, v)

    # frag_reassembly: sequences of packets.
    dg4 = udp(LAPTOP4, POD4, 40001, 7007, bytes(range(256)) * 4)
    dg6 = udp(LAPTOP6, POD6, 40001, 7007, bytes(range(256)) * 4)
    f4 = frags4(dg4, 17, 256)
    f6 = frags6(dg6, 17, 256)
    write("frag_reassembly", "v4_in_order", chunks(f4))
    write("frag_reassembly", "v4_reversed", chunks(list(reversed(f4))))
    write("frag_reassembly", "v4_duplicate", chunks([f4[0], f4[0]] + f4[1:]))
    write("frag_reassembly", "v4_missing_last", chunks(f4[:-1]))
    write("frag_reassembly", "v6_in_order", chunks(f6))
    write("frag_reassembly", "v6_reversed", chunks(list(reversed(f6))))
    write("frag_reassembly", "v4_overlap", chunks([f4[0], frags4(dg4, 17, 128)[1]] + f4[1:]))
    write("frag_reassembly", "mixed_whole", chunks([pk["udp_v4"], f4[1], f6[0], f4[0], f6[1]] + f4[2:] + f6[2:]))
    write("frag_reassembly", "icmp_v4", chunks(frags4(icmp4_echo(1, 1, b"p" * 600), 1, 200)))
    write("frag_reassembly", "two_datagrams", chunks(f4[:2] + frags4(dg4, 17, 512, ident=8) + f4[2:]))

    # engine_ingest: sessions.
    write("engine_ingest", "tcp_v4_session", chunks([
        t4(SYN, 1000, opts=MSS), t4(ACK, 1001, 1), t4(ACK | PSH, 1001, 1, b"hello"),
        t4(FIN | ACK, 1006, 1), t4(ACK, 1007, 2)]))
    write("engine_ingest", "tcp_v4_reset", chunks([t4(SYN, 1000, opts=MSS), t4(RST, 1001)]))
    write("engine_ingest", "tcp_v6_session", chunks([
        t6(SYN, 5, opts=MSS), t6(ACK, 6, 1), t6(ACK | PSH, 6, 1, b"x" * 100), t6(FIN | ACK, 106, 1)]))
    write("engine_ingest", "udp_v4", chunks([u4(b"a"), u4(b"bb"), u4(b"ccc"), u4(b"dddd")]))
    write("engine_ingest", "udp_v6", chunks([u6(b"a"), u6(b"bb")]))
    write("engine_ingest", "ping_v4", chunks([ping4(1), ping4(2), ping4(3)]))
    write("engine_ingest", "ping_v6", chunks([ping6(1), ping6(2)]))
    write("engine_ingest", "frag_udp_v4", chunks(f4))
    write("engine_ingest", "frag_udp_v6", chunks(f6))
    write("engine_ingest", "bad_source", chunks([pk["bad_source_v4"], pk["udp_v4"]]))
    write("engine_ingest", "too_big", chunks([u4(b"q" * 9100)]))
    write("engine_ingest", "mixed", chunks([t4(SYN, 1, opts=MSS), u4(b"u"), ping4(1), t6(SYN, 2, opts=MSS), u6(b"v"), ping6(9), t4(ACK, 2, 1)]))
    write("engine_ingest", "clusterip_dns", chunks([pk["udp_dns_v4"], pk["tcp_syn_clusterip"]]))

    # lease_hello.
    lr = lambda cid: b"\x00" + pb_str(1, cid)
    hl = lambda ip, tok: b"\x01" + hello(ip, tok)
    write("lease_hello", "lease_then_hello", chunks([lr("client-abc"), hl(LAPTOP4, b"token-0")]))
    write("lease_hello", "two_clients", chunks([lr("client-a"), lr("client-b"), hl(bytes([100, 96, 0, 3]), b"token-1"), hl(LAPTOP4, b"token-1")]))
    write("lease_hello", "wrong_token", chunks([lr("c1"), hl(LAPTOP4, b"nope")]))
    write("lease_hello", "no_lease", chunks([hl(LAPTOP4, b"token-0")]))
    write("lease_hello", "bad_client_id", chunks([lr("bad id with spaces"), lr(""), lr("x" * 200)]))
    write("lease_hello", "expiry", chunks([lr("c1"), b"\xfe", b"\xfe", b"\xfe", hl(LAPTOP4, b"token-0")]))
    write("lease_hello", "v6_hello", chunks([lr("c1"), hl(LAPTOP6, b"token-0")]))
    write("lease_hello", "same_client_twice", chunks([lr("c1"), lr("c1"), hl(LAPTOP4, b"token-0")]))

    # dns_query.
    qs = {
        "a_single_label": dns_query("web"),
        "a_ns_relative": dns_query("web.dev"),
        "a_fqdn_cluster": dns_query("web.dev.svc.cluster.local", edns=1232),
        "aaaa_cluster": dns_query("web.dev.svc.cluster.local", "AAAA"),
        "a_upstream": dns_query("www.example.com", edns=4096),
        "ptr_pod": dns_query("11.1.244.10.in-addr.arpa", "PTR"),
        "ptr_v6": dns_query(".".join("0123456789abcdef0123456789abcdef") + ".ip6.arpa", "PTR"),
        "srv": dns_query("_http._tcp.web.dev.svc.cluster.local", "SRV"),
        "txt_single": dns_query("web", "TXT"),
        "ns_single": dns_query("com", "NS"),
        "any": dns_query("web.dev", "ANY"),
        "other_domain": dns_query("api.k8s.example", "AAAA"),
        "two_questions": dns_query("web", qdcount=2),
        "no_question": dns_query("web", qdcount=0),
        "response_bit": dns_query("web", flags=0x8100),
        "opcode_status": dns_query("web", flags=0x1000),
        "edns_small": dns_query("web.dev", edns=100),
        "short_header": dns_query("web")[:7],
        "trailing": dns_query("web") + b"\x00\x01",
        "compressed_loop": struct.pack("!HHHHHH", 1, 0x100, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01",
        "uppercase": dns_query("WEB.Dev.SVC.cluster.LOCAL"),
    }
    for k, v in qs.items():
        write("dns_query", k, v)

    # dns_answer: the query, then answers.
    q1 = dns_query("web.dev.svc.cluster.local", edns=1232)
    q2 = dns_query("web", qid=7)
    q3 = dns_query("www.example.com", qid=9, edns=512)
    a_rec = rr(PTR0, "A", 30, bytes([10, 96, 0, 100]))
    ede = opt_rr(1232, struct.pack("!HH", 15, 6) + struct.pack("!H", 22) + b"down")
    write("dns_answer", "a_noerror", chunks([q1, dns_answer(q1, 0, [a_rec])]))
    write("dns_answer", "nxdomain_soa", chunks([q2, dns_answer(q2, 3, authority=[rr(dns_name("cluster.local"), "SOA", 30, SOA)])]))
    write("dns_answer", "expanded_two", chunks([q2, dns_answer(q2, 3), dns_answer(dns_query("web.dev.svc.cluster.local", qid=7), 0, [a_rec, a_rec])]))
    write("dns_answer", "servfail_ede", chunks([q1, dns_answer(q1, 2, additional=[ede])]))
    write("dns_answer", "truncated", chunks([q1, dns_answer(q1, 0, [a_rec] * 3, tc=True)]))
    write("dns_answer", "upstream_big", chunks([q3, dns_answer(q3, 0, [rr(PTR0, "TXT", 60, b"\xff" + b"t" * 255)] * 4)]))
    write("dns_answer", "cname_chain", chunks([q1, dns_answer(q1, 0, [rr(PTR0, "CNAME", 5, dns_name("other.dev.svc.cluster.local")), rr(dns_name("other.dev.svc.cluster.local"), "A", 5, bytes(4))])]))
    write("dns_answer", "refused", chunks([q2, dns_answer(q2, 5)]))
    write("dns_answer", "wrong_id", chunks([q2, dns_answer(dns_query("web", qid=8), 0, [a_rec])]))
    write("dns_answer", "aaaa_answer", chunks([dns_query("web", "AAAA"), dns_answer(dns_query("web", "AAAA"), 0, [rr(PTR0, "AAAA", 5, POD6)])]))
    write("dns_answer", "garbage_answer", chunks([q2, b"\x00\x07\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00\x03"]))

    # dns_cluster_config: servers, domain, search…
    cc = {
        "lab": ["10.96.0.10", "cluster.local", "dev.svc.cluster.local", "svc.cluster.local", "cluster.local"],
        "two_servers": ["10.96.0.10,10.96.0.11:5353", "cluster.local"],
        "v6": ["[fd00::a]:53,fd00::b", "k8s.example", "ns.svc.k8s.example"],
        "bad_server": ["dns.example", "cluster.local"],
        "empty_domain": ["10.96.0.10", "", "a.b"],
        "bad_domain": ["10.96.0.10", "bad..domain"],
        "trailing_dots": ["10.96.0.10", "cluster.local.", "dev.svc.cluster.local."],
        "long_label": ["10.96.0.10", "x" * 70 + ".local"],
    }
    for k, v in cc.items():
        write("dns_cluster_config", k, chunks([s.encode() for s in v]))

    # ssh_config.
    sc = {
        "three_hops": "Host bastion\n  HostName 10.0.0.1\n  User ops\n  Port 2222\n  IdentityFile ~/.ssh/id_ed25519\n\n"
                      "Host inner\n  HostName 10.0.1.1\n  ProxyJump bastion\n\nHost api\n  HostName 10.0.2.1\n  ProxyJump inner\n  User admin\n",
        "cycle": "Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n",
        "wildcards": "Host *.lab !bad.lab\n  User labuser\nHost *\n  ServerAliveInterval 30\n  StrictHostKeyChecking accept-new\n",
        "equals": "Host=x\nHostName=10.1.1.1\nPort=22\nUser=me\n",
        "jump_list": "Host api\n  ProxyJump ops@10.0.0.1:2222,[fd00::1]:22,jump2\n",
        "match_block": "Match host x exec \"true\"\n  User m\nHost y\n  HostName y.example\n",
        "unknown_fields": "Host x\n  Foo bar\n  ControlMaster auto\n  ControlPath ~/.ssh/cm-%r@%h:%p\n  ForwardAgent yes\n",
        "bad_port": "Host x\n  Port 99999\n",
        "quoted": "Host \"quoted name\"\n  HostName \"10.0.0.9\"\n  IdentityFile \"~/my keys/id\"\n",
        "proxy_none": "Host x\n  ProxyJump none\n  HostName 10.0.0.2\n",
        "comments_tabs": "# comment\n\tHost\tt\n\t\tHostName\t10.0.0.3 # trailing\n",
        "crlf": "Host w\r\n  HostName 10.0.0.4\r\n  User w\r\n",
    }
    for k, v in sc.items():
        write("ssh_config", k, v)

    # known_hosts.
    ed = "AAAAC3NzaC1lZDI1NTE5AAAAIFt4zzXfhCVNVycP7Q5N1YqdYnUxoHkr6gWBaV7c89t6"
    ed2 = "AAAAC3NzaC1lZDI1NTE5AAAAINp1Qz1/NbRwzYsihWO/L47kTet0OFcDRPzvpfgKy+VD"
    hashed = "|1|fLSPmUe2lmk0WWen/ahdH+SW0IQ=|269eleEXIa1+aDSh1L/BMFzIiX8="
    ecdsa = ("AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBEmKSENjQEezOmxkZMy7opKgwFB9nkt5YRrYMjNuG5N87uRgg6CLrbo5wAdT/y6v0mKV0U2w0WZ2YB/++Tpockg=")
    kh = {
        "plain": f"bastion ssh-ed25519 {ed}\n",
        "bracketed_port": f"[bastion]:2222 ssh-ed25519 {ed}\n",
        "hashed": f"{hashed} ssh-ed25519 {ed}\n",
        "list_negation": f"*.lab,!bad.lab,10.0.0.1 ssh-ed25519 {ed}\n",
        "revoked": f"@revoked * ssh-ed25519 {ed}\nbastion ssh-ed25519 {ed}\n",
        "cert_authority": f"@cert-authority *.lab ssh-ed25519 {ed}\n",
        "changed": f"bastion ssh-ed25519 {ed2}\n# comment\n\nbastion ecdsa-sha2-nistp256 {ecdsa}\n",
        "garbage": "not a line\nbastion ssh-ed25519 !!!notbase64\nbastion\n@revoked\n",
        "wildcard_q": f"10.0.0.? ssh-ed25519 {ed}\n[10.0.0.*]:22* ssh-ed25519 {ed}\n",
        "v6": f"[fd00::1]:2222,fd00::2 ssh-ed25519 {ed}\n",
        "comment_field": f"bastion ssh-ed25519 {ed} ops@laptop\n",
    }
    for k, v in kh.items():
        write("known_hosts", k, v)

    # cidr_flags.
    cf = {
        "apiserver": "kube-apiserver --advertise-address=10.0.0.1 --service-cluster-ip-range=10.96.0.0/12 --etcd-servers=https://127.0.0.1:2379\n",
        "controller_manager": "kube-controller-manager --cluster-cidr 10.244.0.0/16,fd00:10:244::/56 --allocate-node-cidrs=true\n",
        "proxy_sh": "sh -c \"kube-proxy --cluster-cidr=10.244.0.0/16 --v=2\"\n",
        "dual_stack": "--service-cluster-ip-range='10.96.0.0/12,fd00:10:96::/112'\n",
        "kubeadm": "apiVersion: kubeadm.k8s.io/v1beta3\nkind: ClusterConfiguration\nnetworking:\n  dnsDomain: cluster.local\n  podSubnet: 10.244.0.0/16\n  serviceSubnet: \"10.96.0.0/12\" # default\n",
        "kube_proxy_config": "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16,fd00:10:244::/56\n",
        "refusal": "Service \"probe\" is invalid: spec.clusterIPs: Invalid value: []string{\"1.1.1.1\"}: failed to allocate IP 1.1.1.1: provided IP is not in the valid range. The range of valid IPs is 10.96.0.0/12\n",
        "host_bits": "--cluster-cidr=10.244.1.7/16 10.244.1.7 10.96.0.1\n",
        "bad_values": "--cluster-cidr=nope --service-cluster-ip-range= --cluster-cidr\n",
        "ips_in_range": "--cluster-cidr=10.0.0.0/8 10.0.0.1 10.255.255.255 ::1 fd00::1\n",
        "zero_prefix": "--cluster-cidr=0.0.0.0/0,::/0 172.31.255.1\n",
    }
    for k, v in cf.items():
        write("cidr_flags", k, v)

    # kubeconfig.
    kc = {
        "basic": "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: https://172.31.255.1:6443\n    certificate-authority-data: AAAA\n"
                 "users:\n- name: admin\n  user:\n    token: abc\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: admin\n    namespace: dev\ncurrent-context: lab\n",
        "exec_plugin": "apiVersion: v1\nclusters:\n- name: c\n  cluster: {server: 'https://[fd00::1]:443'}\nusers:\n- name: u\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n      args: [eks, get-token]\n"
                       "contexts:\n- {name: x, context: {cluster: c, user: u}}\ncurrent-context: x\n",
        "no_current": "clusters: [{name: c, cluster: {server: http://h}}]\ncontexts: [{name: x, context: {cluster: c}}]\n",
        "missing_cluster": "contexts: [{name: x, context: {cluster: nope, user: u}}]\ncurrent-context: x\n",
        "empty": "",
        "json": "{\"apiVersion\":\"v1\",\"clusters\":[{\"name\":\"c\",\"cluster\":{\"server\":\"https://h:6443/path\"}}],\"contexts\":[{\"name\":\"x\",\"context\":{\"cluster\":\"c\"}}],\"current-context\":\"x\"}",
        "duplicate_names": "clusters:\n- {name: c, cluster: {server: https://a}}\n- {name: c, cluster: {server: https://b}}\ncontexts: [{name: x, context: {cluster: c}}]\ncurrent-context: x\n",
        "anchors": "clusters:\n- &c {name: c, cluster: {server: https://a}}\ncontexts: [{name: x, context: {cluster: c}}]\ncurrent-context: x\nextensions: [{name: e, extension: {a: 1}}]\n",
    }
    for k, v in kc.items():
        write("kubeconfig", k, v)

    # manager_messages: even tag LeaseResponse, odd tag RoutesUpdate.
    lease = b"\x00" + pb_str(1, "100.96.0.2") + pb_str(2, "100.96.0.1") + pb_str(3, "100.96.0.0/16") + pb_str(4, "tok") + pb_varint(5, 600)
    svc = pb_str(1, "dev") + pb_str(2, "web") + pb_str(3, "10.96.0.100") + pb_msg(4, pb_str(1, "http") + pb_varint(2, 80) + pb_str(3, "TCP"))
    svc_out = pb_str(1, "dev") + pb_str(2, "far") + pb_str(3, "192.168.50.7") + pb_str(3, "fd00:96::7")
    dns = pb_str(1, "10.96.0.10") + pb_str(2, "cluster.local") + pb_str(3, "dev.svc.cluster.local")
    snap = b"\x01" + pb_varint(1, 1) + pb_str(2, "10.244.1.0/24") + pb_str(2, "10.245.0.0/24") + pb_msg(4, svc) + pb_msg(4, svc_out) + pb_msg(6, dns) + pb_str(7, "node spec.podCIDR")
    delta = b"\x03" + pb_str(3, "10.245.0.0/24") + pb_str(2, "fd00:10:244:7::/64") + pb_msg(5, pb_str(1, "dev") + pb_str(2, "far"))
    write("manager_messages", "lease", chunks([lease]))
    write("manager_messages", "snapshot", chunks([snap]))
    write("manager_messages", "snapshot_delta", chunks([lease, snap, delta]))
    write("manager_messages", "bad_cidrs", chunks([b"\x01" + pb_str(2, "not a cidr") + pb_str(2, "10.244.9.9/24") + pb_str(2, "172.31.255.0/24")]))
    write("manager_messages", "bad_lease", chunks([b"\x00" + pb_str(1, "::zz") + pb_str(3, "100.96.0.0/33")]))
    write("manager_messages", "refused_then_snapshot", chunks([delta, snap, snap]))
    write("manager_messages", "keep_out_covered", chunks([b"\x01" + pb_varint(1, 1) + pb_str(2, "172.31.0.0/16") + pb_msg(4, pb_str(1, "a") + pb_str(2, "b") + pb_str(3, "172.31.255.1"))]))


if __name__ == "__main__":
    main()
