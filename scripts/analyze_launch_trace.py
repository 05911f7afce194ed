import json, sys
for path in sys.argv[1:]:
    recs = json.load(open(path))["records"]
    print(path, len(recs), "steps")
    keys = ["t_graph_try_run", "t_compute_logits", "t_build_step_inputs", "t_fill_placeholders", "t_forward_logits", "t_launch_sampling", "dev_alloc", "dev_free", "host_alloc", "host_free"]
    blocked = [r for r in recs if r.get("launch", 0) > 0.05]
    other = [r for r in recs if r.get("launch", 0) <= 0.05]
    for name, rows in (("blocked", blocked), ("other", other)):
        if rows:
            print(name, len(rows), {k: round(sum(r.get(k, 0) for r in rows) / len(rows) * (1000 if k.startswith("t_") else 1), 2) for k in keys})
    for i, r in enumerate(recs[:40]):
        print(i, r["tokens"], round(r.get("launch", 0) * 1000, 1), round(r.get("wait", 0) * 1000, 1),
              {k: (round(r[k] * 1000, 1) if k.startswith("t_") else r[k]) for k in keys if k in r})
