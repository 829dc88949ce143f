"""The program that runs call and script cases inside the sandbox (shipped as a file into it, never imported by
the host). It executes the solution, then each case with its own time budget, with the solution's prints
captured, and prints one result line: ``<nonce> <json list of booleans>``.

A solution shares the interpreter with its tests, so a determined one could forge that line; stdin/stdout cases
(compared on the host) cannot be forged this way.
"""

HARNESS = r'''
import contextlib, io, json, signal, sys
spec = json.load(open("cases.json"))
out = sys.stdout
def on_alarm(signum, frame):
    raise TimeoutError("case time limit")
signal.signal(signal.SIGALRM, on_alarm)
sink = io.StringIO()
g = {"__name__": "solution"}
results = []
try:
    with contextlib.redirect_stdout(sink):
        signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
        exec(compile(open("solution.py").read(), "solution.py", "exec"), g)
        signal.setitimer(signal.ITIMER_REAL, 0)
    ready = True
except BaseException:
    ready = False
for case in spec["cases"]:
    ok = False
    if ready:
        try:
            with contextlib.redirect_stdout(sink):
                signal.setitimer(signal.ITIMER_REAL, spec["timeout_s"])
                if case["kind"] == "call":
                    fn = g.get(case["fn_name"]) or getattr(g["Solution"](), case["fn_name"])
                    got = fn(*json.loads(case["code"]))
                    got = json.loads(json.dumps(got))
                    ok = got == case["expected"] or [got] == case["expected"]
                else:
                    exec(compile(case["code"], "test.py", "exec"), dict(g))
                    ok = True
        except BaseException:
            ok = False
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    results.append(ok)
out.write(spec["nonce"] + " " + json.dumps(results) + "\n")
out.flush()
'''
