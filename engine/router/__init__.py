"""`kvtier router`: an OpenAI-compatible front over several `kvtier serve` instances that
routes each request by where its prompt's KV is (issue 46).

Module map: app (routes, forwarding, retries, the process), upstream (the HTTP/1.1
client to the instances: kept-alive connections, answers relayed as they arrive),
workers (the pool: health, load, facts, event streams), event_stream (one instance's KV
events over ZMQ, with replay), fleet_index (instance -> block -> medium), naming (a
request's blocks, named as the instance names them), policies (kv, round-robin,
least-load, session), metrics.
"""
