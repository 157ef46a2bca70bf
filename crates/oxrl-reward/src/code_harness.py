# The harness of the code reward's assert tests (see code.rs). It is the run's main.py; the
# solution, the tests and a per-run token arrive on stdin (`<length>\n<json>`), read before the
# solution runs, so no file holds them. The token is written to stdout only after the solution
# and every test ran without an exception; a run passes only with it as its last line.
#
# Comparisons in the tests are strict: both sides are turned into plain built-in values (an
# int/str/list/dict... subclass into its stored base value, through the base type's own C
# methods), anything else fails the test; so an object with `__eq__` returning True, or an int
# subclass overriding it, compares as what it really holds. The tests see the built-ins as they
# were before the solution ran, in their own globals; solution and tests run in a thread whose
# frames do not lead to the one holding the token.


def _oxrl_harness():
    import ast
    import builtins
    import json
    import os
    import sys
    import traceback
    from threading import Thread

    read, write, exit_ = os.read, os.write, os._exit
    stdout, stderr = sys.stdout, sys.stderr
    exc_to_text = traceback.format_exception
    realpath = os.path.realpath

    def read_exactly(n):
        buf = b""
        while len(buf) < n:
            chunk = read(0, n - len(buf))
            if not chunk:
                exit_(3)
            buf += chunk
        return buf

    line = b""
    while not line.endswith(b"\n"):
        line += read_exactly(1)
    payload = json.loads(read_exactly(int(line)))
    token = ("\n" + payload["token"] + "\n").encode()
    solution, tests = payload["solution"], payload["tests"]
    del payload, line

    type_, isinstance_, len_, id_, bool_ = type, isinstance, len, id, bool
    BaseException_, AssertionError_, RecursionError_ = (
        BaseException,
        AssertionError,
        RecursionError,
    )
    scalars = (type(None), bool, int, float, complex, str, bytes, range, type)
    # Base types whose own C method gives a subclass instance's stored value as the base type.
    bases = (
        (int, int.__int__),
        (float, float.__float__),
        (str, str.__str__),
        (bytes, bytes.__bytes__),
    )
    list_copy, dict_copy, set_copy, frozenset_copy = (
        list.copy,
        dict.copy,
        set.copy,
        frozenset.copy,
    )
    tuple_iter, dict_items = tuple.__iter__, dict.items
    tuple_, list_, frozenset_ = tuple, list, frozenset

    class NotPlain(Exception):
        pass

    def plain(v, depth=0):
        """`v` as built-in values only, or NotPlain."""
        if depth > 200:
            raise NotPlain("nested too deeply")
        t = type_(v)
        for s in scalars:
            # `is`, never `==` or `in`: a metaclass could make a class equal to anything.
            if t is s:
                return v
        if t is list or t is tuple or t is dict or t is set or t is frozenset:
            pass
        elif isinstance_(v, list):
            v, t = list_copy(v), list
        elif isinstance_(v, tuple):
            v, t = tuple_(tuple_iter(v)), tuple
        elif isinstance_(v, dict):
            v, t = dict_copy(v), dict
        elif isinstance_(v, set):
            v, t = set_copy(v), set
        elif isinstance_(v, frozenset):
            v, t = frozenset_copy(v), frozenset
        else:
            for base, value in bases:
                if isinstance_(v, base):
                    return value(v)
            raise NotPlain(f"a {t.__name__} is not a plain value")
        if t is list:
            return [plain(x, depth + 1) for x in v]
        if t is tuple:
            return tuple_(plain(x, depth + 1) for x in v)
        if t is dict:
            return {plain(k, depth + 1): plain(x, depth + 1) for k, x in dict_items(v)}
        if t is set:
            return {plain(x, depth + 1) for x in v}
        return frozenset_(plain(x, depth + 1) for x in v)

    def strict(v):
        try:
            return plain(v)
        except (NotPlain, RecursionError_) as e:
            raise AssertionError_(f"compared {e}") from None

    ops = {
        "==": lambda a, b: strict(a) == strict(b),
        "!=": lambda a, b: strict(a) != strict(b),
        "<": lambda a, b: strict(a) < strict(b),
        "<=": lambda a, b: strict(a) <= strict(b),
        ">": lambda a, b: strict(a) > strict(b),
        ">=": lambda a, b: strict(a) >= strict(b),
        "in": lambda a, b: strict(a) in strict(b),
        "not in": lambda a, b: strict(a) not in strict(b),
        "is": lambda a, b: a is b,
        "is not": lambda a, b: a is not b,
    }

    def compare(names, *values):
        for i in range(len_(names)):
            if not ops[names[i]](values[i], values[i + 1]):
                return False
        return True

    def truth(v):
        return bool_(strict(v))

    names = {
        ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
        ast.GtE: ">=", ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not",
    }

    class Strict(ast.NodeTransformer):
        """Every comparison through `compare`, every assert through `truth`."""

        def visit_Compare(self, node):
            self.generic_visit(node)
            ops_ = ast.Tuple([ast.Constant(names[type(o)]) for o in node.ops], ast.Load())
            call = ast.Call(
                ast.Name("__oxrl_compare", ast.Load()),
                [ops_, node.left, *node.comparators],
                [],
            )
            return ast.copy_location(call, node)

        def visit_Assert(self, node):
            self.generic_visit(node)
            check = ast.Call(ast.Name("__oxrl_truth", ast.Load()), [node.test], [])
            exc = ast.Call(
                ast.Name("__oxrl_AssertionError", ast.Load()),
                [node.msg] if node.msg else [],
                [],
            )
            fail = ast.If(ast.UnaryOp(ast.Not(), check), [ast.Raise(exc, None)], [])
            return ast.copy_location(fail, node)

    def fail(what, e):
        try:
            stdout.flush()
        except BaseException_:
            pass
        try:
            text = "".join(exc_to_text(e)) if e is not None else "\n"
        except BaseException_:
            text = "an exception that cannot be shown\n"
        write(2, f"{what}:\n{text}".encode(errors="replace"))
        exit_(1)

    # Everything the tests need is made before the solution runs.
    try:
        tree = Strict().visit(ast.parse(tests, "tests.py"))
        test_code = compile(ast.fix_missing_locations(tree), "tests.py", "exec")
        solution_code = compile(solution, "solution.py", "exec")
    except SyntaxError as e:
        fail("the program does not compile", e)
    del tests, solution, tree
    builtins_before = dict(builtins.__dict__)

    # Introspection that would find the token in this process's memory is refused (this raises
    # the bar; frames stay reachable, see the README).
    blocked = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"}

    def audit(event, args):
        if event in blocked or event.startswith("ctypes."):
            raise RuntimeError(f"{event} is not allowed in the sandbox")
        if event == "open" and isinstance_(args[0], (str, bytes)):
            p = args[0] if isinstance_(args[0], str) else args[0].decode(errors="replace")
            if "proc" in p and "mem" in p or realpath(p).endswith("/mem"):
                raise RuntimeError("reading process memory is not allowed in the sandbox")

    sys.addaudithook(audit)

    # The solution and the tests run in a thread of their own: walking up its frames ends at
    # the thread's start, so this frame, the only one holding the token, is out of their reach
    # (sys._current_frames and gc are refused above).
    outcome = []

    def work():
        g = {"__name__": "__main__", "__builtins__": builtins}
        try:
            exec(solution_code, g)
        except BaseException_ as e:
            outcome.append(("the solution raised", e))
            return
        # The tests run in globals of their own (a solution's function rebinding its globals
        # does not reach them) with the built-ins as they were before the solution.
        t = dict(g)
        t["__builtins__"] = builtins_before
        t["__oxrl_compare"] = compare
        t["__oxrl_truth"] = truth
        t["__oxrl_AssertionError"] = AssertionError_
        try:
            exec(test_code, t)
        except BaseException_ as e:
            outcome.append(("a test failed", e))
            return
        outcome.append(None)

    worker = Thread(target=work, name="solution")
    worker.start()
    worker.join()
    if len_(outcome) != 1 or outcome[0] is not None:
        what, e = outcome[0] if len_(outcome) and outcome[0] else ("the tests did not end", None)
        fail(what, e)
    try:
        stdout.flush()
        stderr.flush()
    except BaseException_:
        pass
    write(1, token)
    exit_(0)


_oxrl_harness()
