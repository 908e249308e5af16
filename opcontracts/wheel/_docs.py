"""torch_npu's ``_op_plugin_docs.py``, read with ``ast``: per op, per argument, the dtypes the
docstring lists, the line each statement comes from, and what could not be read and why.

The file is a list of ``_add_torch_npu_docstr("op", "...")`` calls; an op documented twice
keeps the later block, as at import.  The docstrings are Chinese and free-form; the reader:

* finds the parameter section (``参数说明``, ``参数``, ``输入``, ``接口说明`` ...) and, in it, one
  entry per argument (``x (Tensor) - ...``, ``x：Tensor类型，...``, ``“x”：...``, ``Tensor x：...``),
  unescaping Markdown (``weight\\_scale``);
* maps doc names to schema names: exactly, then, for names the schema does not have (rotary_mul's
  ``input``/``cos``/``sin`` for ``self``/``r1``/``r2``, swiglu's ``x``), by position between the
  names that do match, when the counts agree;
* reads dtype statements (``数据类型支持float16、bfloat16``, ``dtype支持FP32、FP16或BF16``,
  ``数据类型为`int32```, ``仅支持float16``), keeping per-chip or per-scenario lines
  (``Atlas A2 ...：数据类型支持...``) as conditional statements whose union is the argument's set;
  clauses that state a condition (``当x数据类型为int8时``) are not statements;
* resolves "same dtype as x" (``数据类型与x一致``, ``数据类型同x``, ``数据类型需要和self保持一致``)
  to x's set, and remembers the coupling;
* reads ranks (``2维Tensor``, ``2D的Tensor``, ``shape支持1-8维``) for drafts.

Nothing is guessed silently: an argument without a statement says why (``why``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import Any

from ._schema import OpSchema
from ._source import parse_source

__all__ = ["DtypeStatement", "ArgDoc", "OpDoc", "doc_blocks", "parse_block", "parse_docs",
           "DOC_DTYPES", "dtype_token"]

# doc spelling (lower case) -> canonical name; torch names where torch has the dtype
DOC_DTYPES: dict[str, str] = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float64": "float64", "fp64": "float64", "double": "float64",
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "bool": "bool", "complex64": "complex64", "complex128": "complex128",
    "complex32": "complex32",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
    "float8_e8m0fnu": "float8_e8m0fnu", "float8_e8m0": "float8_e8m0fnu",
    "hifloat8": "hifloat8", "int4": "int4", "quint4x2": "quint4x2", "qint8": "qint8",
    "float4_e2m1fn_x2": "float4_e2m1fn_x2", "float4_e2m1": "float4_e2m1fn_x2",
    "float4_e1m2fn_x2": "float4_e1m2fn_x2", "float4_e1m2": "float4_e1m2fn_x2",
    "bits8": "bits8",
}

_TOKEN = re.compile(
    r"(?:torch(?:_npu)?\.)?(" + "|".join(sorted((re.escape(k) for k in DOC_DTYPES),
                                              key=len, reverse=True)) + r")(?![A-Za-z0-9_])",
    re.IGNORECASE)
_SEP = re.compile(r"(?:\s|、|,|，|/|和|或|及|以及|与|`|'|\"|“|”|类型|\(|\)|（|）)*", re.IGNORECASE)
_TRIGGER = re.compile(
    r"(数据类型|dtype|输入类型|类型支持|仅支持|只支持|支持的数据类型|支持)", re.IGNORECASE)
_FILLER = re.compile(
    r"^(?:\s|：|:|=|是|为|要求|要求为|需要|需要为|需为|必须为|必须是|须为|仅|只|支持|均|可以|可以是|"
    r"固定为|类型|的数据类型|数据类型|`|'|\"|“|”|\(|（)*", re.IGNORECASE)
_SAME = re.compile(
    r"(?:数据类型|dtype|类型)(?:支持范围|范围)?(?:(?:、|和)[^，,。；;与和同]{1,10}?)?\s*"
    r"(?:需要|要求|需|须|必须|均需要|应|保持)?\s*"
    r"(?:和|与|同|跟)\s*(?:输入|入参|参数)?\s*[`“\"']?([A-Za-z_][A-Za-z0-9_\\]*)[`”\"']?"
    r"\s*(?:的数据类型|的dtype)?\s*(?:保持)?\s*(一致|相同|一样)?",
    re.IGNORECASE)
_SAME2 = re.compile(
    r"(?:和|与|同)\s*[`“\"']?([A-Za-z_][A-Za-z0-9_\\]*)[`”\"']?\s*(?:的?(?:数据类型|dtype)\s*(?:保持)?\s*"
    r"(一致|相同)|(同)(?:类型|数据类型|dtype))", re.IGNORECASE)
_CHIP = re.compile(r"(Atlas|Ascend|昇腾|\b950|\b910|\b310)", re.IGNORECASE)
_NOUN = re.compile(r"^\s*(?:的)?\s*(?:类型)?\s*(?:的)?\s*(?:ND\s*|[1-8]D\s*|浮点)?\s*(?:张量|Tensor|tensor)")
_RESERVED = re.compile(r"(仅支持(?:传入)?\s*None|只支持传入None|暂不支持|当前不支持|预留参数|暂未使用|传入None即可)")
_CHIP_LINE = re.compile(r"^\s*(?:[-*•]\s*)?(?:和)?(?:Atlas|Ascend)[^:：]{0,60}[:：]")
_COND = re.compile(r"^(?:\s|，|,)*(当|如果|若|在|仅当|对于)")
_RANK = re.compile(
    r"(?<![0-9A-Za-z_\-.])(?:([1-8])\s*(?:[-~～到至]|维或|维、|D或)\s*([1-8])\s*(?:维|D(?![A-Za-z]))"
    r"|([1-8])\s*(?:维|D(?![A-Za-z])))")

_HEAD_PARAMS = re.compile(r"^(?:#+\s*)?(?:\d+[.、]\s*)?(参数说明|参数列表|参数解释|输入参数|参数|输入|接口说明)"
                          r"\s*[:：]?\s*$")
_HEAD_END = re.compile(
    r"^(?:#+\s*)?(?:\d+[.、]\s*)?(输出说明|输出参数|输出|返回值说明|返回值|返回|约束说明|输入约束|约束与限制|约束|"
    r"调用示例|示例代码|示例|支持的型号|支持的PyTorch版本|支持版本|计算公式|算子约束|注意事项)"
    r"\s*\d*\s*[:：]?\s*$")
_ENTRY = re.compile(
    r"^\s*(?:[-*•]\s*)?(?:\d+[.、)]\s*)?(?:(?:Tensor\??|int|float|bool|str|Tensor\[\])\s+)?"
    r"[“\"'`]?(?P<name>[A-Za-z_][A-Za-z0-9_\\]*)[”\"'`]?\s*"
    r"(?P<sep>\(|（|:|：|,|，|\s-|-\s|=)")
_PROTO = re.compile(r"torch_npu\.([A-Za-z_][A-Za-z0-9_]*)\s*\((.*?)\)\s*(?:->|$)")


@dataclass(frozen=True)
class DtypeStatement:
    dtypes: tuple[str, ...]
    line: str
    """the doc line the statement is on (stripped, at most 240 characters)"""
    condition: str | None = None
    """the chip or scenario the statement is limited to (``Atlas A2 训练系列产品``), if any"""


@dataclass
class ArgDoc:
    name: str
    """the schema's name"""
    doc_name: str
    line: str
    """the entry's first line"""
    dtypes: tuple[str, ...] | None = None
    """every dtype the doc lists for this argument (the union of its statements), or None"""
    same_as: str | None = None
    """the argument whose dtype this one must have (schema name)"""
    same_line: str | None = None
    statements: list[DtypeStatement] = field(default_factory=list)
    rank: tuple[int, ...] | None = None
    rank_line: str | None = None
    reserved: str | None = None
    """the line saying the argument is reserved or must be None (``当前仅支持传入None``)"""
    why: str | None = None
    """why no dtype could be read, when ``dtypes`` is None"""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"line": self.line}
        if self.doc_name != self.name:
            out["doc_name"] = self.doc_name
        if self.dtypes is not None:
            out["dtypes"] = list(self.dtypes)
        if self.same_as:
            out["same_as"] = self.same_as
            out["same_line"] = self.same_line
        if self.statements:
            out["statements"] = [[list(s.dtypes), s.line, s.condition] for s in self.statements]
        if self.rank:
            out["rank"] = list(self.rank)
            out["rank_line"] = self.rank_line
        if self.reserved:
            out["reserved"] = self.reserved
        if self.why:
            out["why"] = self.why
        return out

    @classmethod
    def from_json(cls, name: str, d: dict[str, Any]) -> ArgDoc:
        return cls(
            name, d.get("doc_name", name), d.get("line", ""),
            tuple(d["dtypes"]) if d.get("dtypes") is not None else None,
            d.get("same_as"), d.get("same_line"),
            [DtypeStatement(tuple(s[0]), s[1], s[2]) for s in d.get("statements", ())],
            tuple(d["rank"]) if d.get("rank") else None, d.get("rank_line"), d.get("reserved"),
            d.get("why"))


@dataclass
class OpDoc:
    op: str
    blocks: int = 1
    """how many blocks the file has for this op (the last one is read)"""
    args: dict[str, ArgDoc] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """what could not be read and why (no parameter section, unmatched doc names, ...)"""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"args": {k: v.to_json() for k, v in self.args.items()}}
        if self.blocks != 1:
            out["blocks"] = self.blocks
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_json(cls, op: str, d: dict[str, Any]) -> OpDoc:
        return cls(op, d.get("blocks", 1),
                   {k: ArgDoc.from_json(k, v) for k, v in d.get("args", {}).items()},
                   list(d.get("notes", ())))


# --------------------------------------------------------------------------- blocks
def doc_blocks(source: str) -> dict[str, tuple[str, int]]:
    """op -> (its last docstring, how many blocks document it), read with ``ast``: the file
    is never executed (it imports torch_npu)."""
    tree = parse_source(source)
    out: dict[str, tuple[str, int]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and len(node.args) == 2):
            continue
        fn = node.func
        fname = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        if fname not in ("_add_torch_npu_docstr", "add_torch_npu_docstr", "_add_docstr"):
            continue
        a0, a1 = node.args
        if isinstance(a0, ast.Constant) and isinstance(a0.value, str) and \
                isinstance(a1, ast.Constant) and isinstance(a1.value, str):
            prev = out.get(a0.value)
            out[a0.value] = (a1.value, (prev[1] + 1) if prev else 1)
    return out


# --------------------------------------------------------------------------- reading
def _clean(line: str) -> str:
    s = line.replace("\\_", "_").replace("\u200b", "").strip()
    return s if len(s) <= 240 else s[:237] + "..."


def dtype_token(word: str) -> str | None:
    w = word.lower()
    if w.startswith("torch_npu."):
        w = w[len("torch_npu."):]
    if w.startswith("torch."):
        w = w[len("torch."):]
    return DOC_DTYPES.get(w)


def _read_list(text: str) -> tuple[list[str], int]:
    """Dtype tokens at the start of ``text`` (after fillers), separated by 、 , / 和 或 ...;
    returns the tokens and where the list ended."""
    pos = _FILLER.match(text).end()  # type: ignore[union-attr]
    found: list[str] = []
    while True:
        m = _TOKEN.match(text, pos)
        if m is None:
            break
        if found and re.match(r"\s*(?:类型)?\s*(?:时|的时候)", text[m.end():]):
            break  # "int8、bool，int8时取值支持0、1": the last one starts a condition
        name = DOC_DTYPES[m.group(1).lower()]
        if name not in found:
            found.append(name)
        pos = m.end()
        # "float16(仅Atlas A2)"-style parentheticals are skipped, not read as a new statement
        paren = re.match(r"\s*[（(][^)）]{0,40}[)）]", text[pos:])
        if paren and not _TOKEN.match(text[pos:].lstrip(" （(")):
            pos += paren.end()
        sep = _SEP.match(text, pos)
        if sep is None or sep.end() == pos:
            break
        pos = sep.end()
    return found, pos


def _statements(text: str) -> list[tuple[list[str], str, bool]]:
    """(dtypes, clause, conditional) per dtype statement in one line."""
    out = []
    clauses = re.split(r"(?<=[。；;])|(?<=\.)\s|(?<=[，,])(?=\s*(?:当|如果|若))", text)
    for clause in clauses:
        cond_clause = bool(_COND.match(clause))
        chip = _CHIP_LINE.match(clause)
        if chip:  # "Atlas A2 训练系列产品/...: torch.float16、torch.float32" (a list under a heading)
            tokens, _end = _read_list(clause[chip.end():])
            if tokens:
                out.append((tokens, clause, True))
                continue
        consumed = 0
        for m in _TRIGGER.finditer(clause):
            if m.start() < consumed:
                continue
            tokens, end = _read_list(clause[m.end():])
            if not tokens:
                # 仅支持 may come before the trigger word: "仅支持float16" handled by the trigger
                continue
            after = clause[m.end() + end:m.end() + end + 3].lstrip()
            if after.startswith("时") or after.startswith("的时候"):
                continue  # "数据类型为int8时...": a condition, not a statement
            if after.startswith(("输出", "的输出", "结果")):
                continue  # "支持float16输出": an output's dtype
            before = clause[:m.start()]
            if re.search(r"(当|如果|若)[^，,。；;]*$", before):
                continue  # "当x的数据类型为...": a condition
            if re.search(r"(输出|返回)[^，,。；;]{0,12}$", before):
                continue  # the dtype of an output named in an input's entry
            consumed = m.end() + end
            seg = re.split(r"[，,；;。]", before)[-1]
            if _CHIP.search(seg):  # "...，Ascend 950PR上数据类型额外支持int8": that chip only
                out.append((tokens, seg.strip(), True))
                continue
            out.append((tokens, clause, cond_clause))
        if not any(c is clause for _, c, _ in out):
            # "float16或float32类型的张量", "shape为(num,N)的int32 3D张量", "1D uint8张量"
            for m in _TOKEN.finditer(clause):
                if any(m.start() < e for e in _spans(out, clause)):
                    continue
                tokens, end = _read_list(clause[m.start():])
                tail = clause[m.start() + end:m.start() + end + 16]
                if tokens and _NOUN.match(tail) and not re.search(
                        r"(当|如果|若|输出|返回)[^，,。；;]*$", clause[:m.start()]):
                    out.append((tokens, clause, cond_clause))
                    break
    return out


def _spans(found: list[tuple[list[str], str, bool]], clause: str) -> list[int]:
    return [len(clause) for _, c, _ in found if c is clause]


def _entries(doc: str, known: set[str]) -> tuple[list[tuple[str, list[str]]], bool, list[str]]:
    """(doc name, lines) per argument entry of the parameter section, whether a parameter
    heading was found, and the prototype's parameter names."""
    lines = doc.splitlines()
    proto: list[str] = []
    for line in lines[:40]:
        m = _PROTO.search(line)
        if m:
            for part in m.group(2).split(","):
                part = part.strip().split("=")[0].strip()
                if part and part != "*":
                    proto.append(part.split()[-1])
            break
    start, heading = 0, False
    for i, line in enumerate(lines):
        if _HEAD_PARAMS.match(line.strip()):
            start, heading = i + 1, True
            break
    entries: list[tuple[str, list[str]]] = []
    names_seen: set[str] = set()
    for line in lines[start:]:
        s = line.strip()
        if not s:
            continue
        if _HEAD_END.match(s) and (heading or entries):
            if s.startswith("输出") and not entries:
                continue
            break
        if s.startswith("*") and ("关键字" in s or "位置" in s):
            continue  # "*: the arguments after it are keyword-only"
        m = _ENTRY.match(re.sub(r"\*\*|</?strong>|</?b>", "", s.replace("\\_", "_")))
        if m:
            name = m.group("name").replace("\\", "")
            rest = s[m.end():m.end() + 24]
            looks = name in known or name in proto or bool(
                re.search(r"Tensor|tensor|张量|必选|可选|输入|参数|int|float|bool|str|list", rest))
            if looks and name not in names_seen and not _CHIP.match(name) and \
                    name not in ("None", "True", "False"):
                entries.append((name, [s]))
                names_seen.add(name)
                continue
        if entries:
            entries[-1][1].append(s)
    return entries, heading, proto


def _align(doc_names: list[str], schema: OpSchema) -> tuple[dict[str, str], list[str]]:
    """doc name -> schema name: exact, case-insensitive, then by position between matched
    names when the gaps have the same length; the doc names left unmatched."""
    names = list(schema.names)
    mapping: dict[str, str] = {}
    lower = {n.lower().replace("_", ""): n for n in names}
    for d in doc_names:
        key = d.lower().replace("_", "")
        if d in names:
            mapping[d] = d
        elif key in lower and lower[key] not in mapping.values() and lower[key] not in doc_names:
            mapping[d] = lower[key]
    # gaps: runs of unmatched doc names between matched ones, against the schema's runs
    anchors = [(-1, -1)] + sorted((doc_names.index(d), names.index(s)) for d, s in mapping.items())
    anchors.append((len(doc_names), len(names)))
    for (d0, s0), (d1, s1) in zip(anchors, anchors[1:]):
        gap_doc = [d for d in doc_names[d0 + 1:d1] if d not in mapping]
        gap_schema = [n for n in names[s0 + 1:s1] if n not in mapping.values()]
        if gap_doc and len(gap_doc) == len(gap_schema) and d1 > d0 and s1 > s0:
            for d, s in zip(gap_doc, gap_schema):
                mapping[d] = s
    left = [d for d in doc_names if d not in mapping]
    return mapping, left


def _condition(line: str, clause: str, cond_clause: bool) -> str | None:
    head = line.split("：")[0].split(":")[0] if _CHIP.search(line[:60]) else ""
    if _CHIP.match(line) or (head and _CHIP.search(head) and len(head) < 80):
        return head.strip()
    if cond_clause:
        return clause.strip()[:60]
    return None


def parse_block(op: str, doc: str, schema: OpSchema | None, blocks: int = 1) -> OpDoc:
    """One op's docstring against its schema (``None``: names are kept as the doc spells them)."""
    out = OpDoc(op, blocks)
    known = set(schema.names) if schema is not None else set()
    entries, heading, _proto = _entries(doc, known)
    if not heading:
        out.notes.append("no parameter heading (参数说明); argument entries read from the whole text")
    if not entries:
        ref = re.search(r"(?:参数|输入)[^。\n]{0,20}(?:同|参考|请参见|参见)\s*(?:torch_npu\.)?(npu_[a-z0-9_]+)", doc)
        if ref:
            out.notes.append(f"arguments documented by reference to {ref.group(1)}: not followed")
        else:
            out.notes.append("no argument entries found")
        return out
    doc_names = [n for n, _ in entries]
    if schema is not None:
        mapping, left = _align(doc_names, schema)
        if left:
            out.notes.append("doc names not in the schema: " + ", ".join(left))
    else:
        mapping = {n: n for n in doc_names}
    for doc_name, lines in entries:
        name = mapping.get(doc_name)
        if name is None:
            continue
        param = schema.param(name) if schema is not None else None
        arg = ArgDoc(name, doc_name, _clean(lines[0]))
        is_tensor = param is None or param.is_tensor
        for line in lines:
            clean = line.replace("\\_", "_")
            if is_tensor:
                for tokens, clause, cond_clause in _statements(clean):
                    arg.statements.append(DtypeStatement(
                        tuple(tokens), _clean(line), _condition(clean, clause, cond_clause)))
                if arg.same_as is None:
                    for rx in (_SAME, _SAME2):
                        sm = rx.search(clean)
                        if sm is None:
                            continue
                        partner = sm.group(1).replace("\\", "")
                        partner = mapping.get(partner, partner)
                        if partner != name and (schema is None or partner in known) and (
                                rx is _SAME2 or sm.group(2) or "同" in sm.group(0)):
                            if not re.search(r"(当|如果|若)[^，,。]*$", clean[:sm.start()]):
                                arg.same_as, arg.same_line = partner, _clean(line)
                                break
                if arg.reserved is None and _RESERVED.search(clean):
                    arg.reserved = _clean(line)
                if arg.rank is None:
                    rm = _RANK.search(clean)
                    if rm and re.search(r"(最大|最多|不超过|小于|大于|以内|至少|超过|大于等于|小于等于)\s*(?:支持)?\s*$",
                                        clean[max(0, rm.start() - 6):rm.start()]):
                        rm = None
                    if rm:
                        if rm.group(3):
                            arg.rank = (int(rm.group(3)),)
                        else:
                            lo, hi = int(rm.group(1)), int(rm.group(2))
                            either = "或" in rm.group(0) or "、" in rm.group(0)
                            arg.rank = ((lo, hi) if either else tuple(range(lo, hi + 1))) \
                                if lo < hi else None
                        arg.rank_line = _clean(line) if arg.rank else None
        if arg.statements:
            union: list[str] = []
            for st in arg.statements:
                union += [d for d in st.dtypes if d not in union]
            # unconditional statements win when there are conditional ones too? no: the doc
            # lists every dtype of every statement for some chip or scenario; keep the union
            arg.dtypes = tuple(union)
        if is_tensor:
            out.args[name] = arg
        elif arg.statements or arg.same_as:
            out.args[name] = arg
    # "same dtype as x": x's set, when this argument has none of its own
    for _ in range(3):
        for arg in out.args.values():
            if arg.dtypes is None and arg.same_as:
                partner = out.args.get(arg.same_as)
                if partner is not None and partner.dtypes is not None:
                    arg.dtypes = partner.dtypes
    for arg in out.args.values():
        if arg.dtypes is None:
            if arg.reserved:
                arg.why = "reserved: the doc says it must be None or is not supported yet"
            elif arg.same_as:
                arg.why = f"'same dtype as {arg.same_as}', and {arg.same_as} has no dtype statement"
            else:
                arg.why = "documented, but no dtype statement found in its entry"
    return out


def parse_docs(source: str, schemas: dict[str, OpSchema]) -> dict[str, OpDoc]:
    """Every documented op of ``_op_plugin_docs.py`` (``schemas``: op -> its default schema,
    used to map doc names; ops not in it are read with the doc's own names)."""
    out = {}
    for op, (doc, n) in sorted(doc_blocks(source).items()):
        out[op] = parse_block(op, doc, schemas.get(op), n)
    return out
