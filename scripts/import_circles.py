"""Import circles among src/'s files: prints each group of files that reach one another through their
`crate::` and `super::` paths, and exits 1 if there is any that spans more than one folder. A module's
own children (declared by it) do not count as its imports, nor do a file's `#[cfg(test)] mod tests` or
comments (doc links); files of one folder that use one another are one module's parts, not a circle
between layers. Run from anywhere:
    python3 scripts/import_circles.py
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(rel):
    parts = rel[: -len(".rs")].split("/")
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return "::".join(parts)


def files():
    found = {}
    for folder, _, names in os.walk(ROOT):
        for name in names:
            if name.endswith(".rs"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)
                found[module_of(rel)] = rel
    return found


def imports(text, known, module=""):
    """The modules of `known` that the code in `text` names through `crate::`."""
    cut = text.find("#[cfg(test)]\nmod tests")
    code = text if cut < 0 else text[:cut]
    code = "\n".join(line for line in code.split("\n") if not line.strip().startswith("//"))

    def deepest(path):
        parts = [p for p in path.split("::") if p and p != "self"]
        while parts:
            if "::".join(parts) in known:
                return "::".join(parts)
            parts.pop()
        return None

    found = set()
    for path in re.findall(r"crate::((?:[a-z_0-9]+::)*[A-Za-z_0-9]+)", code):
        found.add(deepest(path))
    for prefix, inner in re.findall(r"crate::((?:[a-z_0-9]+::)*)\{([^}]*)\}", code):
        for item in inner.split(","):
            found.add(deepest(prefix + item.strip().split(" ")[0]))
    # super:: paths, from this module's parent
    parent = module.rsplit("::", 1)[0] + "::" if "::" in module else ""
    for path in re.findall(r"super::((?:[a-z_0-9]+::)*[A-Za-z_0-9]+)", code):
        found.add(deepest(parent + path))
    for prefix, inner in re.findall(r"super::((?:[a-z_0-9]+::)*)\{([^}]*)\}", code):
        for item in inner.split(","):
            found.add(deepest(parent + prefix + item.strip().split(" ")[0]))
    found.discard(None)
    found.discard("")
    return found


def circles(graph):
    """Tarjan's strongly connected components with more than one member."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    known = files()
    graph = {}
    for module, rel in known.items():
        with open(os.path.join(ROOT, rel)) as f:
            deps = imports(f.read(), known, module)
        # a module declares its children: naming them is not an import that could close a circle
        graph[module] = {d for d in deps if d != module and not (module == "" or d.startswith(module + "::"))}
    # a circle among the files of one folder is one module's parts
    folder = lambda m: known[m].rsplit("/", 1)[0] if "/" in known[m] else ""
    found = [g for g in circles(graph) if len({folder(m) for m in g}) > 1]
    for group in found:
        print("import circle:", " -> ".join(known[m] for m in group))
    print(f"{len(found)} import circles among {len(known)} files in src/")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
