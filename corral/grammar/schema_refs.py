"""Local ``$ref`` resolution inside one JSON Schema document.

Supported targets: JSON pointers (``#``, ``#/definitions/a``, ``#/$defs/a~1b``, percent-encoded), plain-name
anchors (``$anchor``, or a draft 4-7 ``$id``/``id`` of the form ``#name``), and embedded sub-schemas named by
their ``$id``/``id`` (resolved against the root's ``$id``). Left out: fetching anything outside the document
(refused with :class:`UnsupportedSchemaError`), and base URIs changed by nested relative ``$id``s.
"""

from urllib.parse import unquote, urldefrag, urljoin

from corral.errors import InvalidSchemaError, UnsupportedSchemaError

_DOCUMENT_KEYWORDS_OF_SCHEMAS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")


def escape_pointer_token(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


class RefResolver:
    def __init__(self, root):
        self.root = root
        self.base = ""
        if isinstance(root, dict):
            root_id = root.get("$id", root.get("id"))
            self.base = urldefrag(root_id)[0] if isinstance(root_id, str) else ""
        self.documents: dict[str, tuple[object, str]] = {self.base: (root, "#")}
        self.anchors: dict[str, tuple[object, str]] = {}
        self._index(root, "#")

    def _index(self, schema, pointer: str) -> None:
        if isinstance(schema, list):
            for i, item in enumerate(schema):
                self._index(item, f"{pointer}/{i}")
            return
        if not isinstance(schema, dict):
            return
        for key in ("$id", "id"):
            value = schema.get(key)
            if isinstance(value, str) and pointer != "#":
                url, fragment = urldefrag(urljoin(self.base, value))
                if fragment:
                    self.anchors.setdefault(fragment, (schema, pointer))
                elif url:
                    self.documents.setdefault(url, (schema, pointer))
        if isinstance(schema.get("$anchor"), str):
            self.anchors.setdefault(schema["$anchor"], (schema, pointer))
        for key, value in schema.items():
            if key in ("enum", "const", "default", "examples", "example"):
                continue
            if key in _DOCUMENT_KEYWORDS_OF_SCHEMAS and isinstance(value, dict):
                for name, sub in value.items():
                    self._index(sub, f"{pointer}/{key}/{escape_pointer_token(name)}")
            elif isinstance(value, (dict, list)):
                self._index(value, f"{pointer}/{key}")

    def resolve(self, ref: str, pointer: str) -> tuple[object, str]:
        """The schema ``ref`` names and its JSON pointer. ``pointer`` is where the ``$ref`` stands (for errors)."""
        # subtle: a fragment-only ref names this document whatever its base (urljoin drops fragments against
        # bases with schemes it does not know, such as classpath:)
        url, fragment = (self.base, ref[1:]) if ref.startswith("#") else urldefrag(urljoin(self.base, ref))
        if url not in self.documents:
            raise UnsupportedSchemaError(f"$ref {ref!r} points outside this schema document, which Corral does not "
                                         f"fetch", keyword="$ref", pointer=pointer)
        document, document_pointer = self.documents[url]
        if not fragment:
            return document, document_pointer
        if not fragment.startswith("/"):
            if fragment not in self.anchors:
                raise InvalidSchemaError(f"$ref {ref!r} names no anchor in this schema", keyword="$ref",
                                         pointer=pointer)
            return self.anchors[fragment]
        target, target_pointer = document, document_pointer
        for raw in fragment[1:].split("/"):
            token = unquote(raw).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                raise InvalidSchemaError(f"$ref {ref!r} points to nothing (dangling reference)", keyword="$ref",
                                         pointer=pointer)
            target_pointer += "/" + escape_pointer_token(token)
        if not isinstance(target, (dict, bool)):
            raise InvalidSchemaError(f"$ref {ref!r} points to a value that is not a schema", keyword="$ref",
                                     pointer=pointer)
        return target, target_pointer
