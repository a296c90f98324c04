"""Ed25519 (RFC 8032, PureEdDSA) in pure Python: the phone verifies agent releases with it
(Python's standard library has no Ed25519, and the agent carries nothing beyond it and numpy).

Written from the RFC's description (section 5.1) with points in extended coordinates. It is
slow (a few milliseconds a signature) and its arithmetic is not constant-time: fine for
`verify`, which handles only public data, once per upgrade. `sign` is here for the control
plane, which signs one release message per build it serves (never a message an outsider
chooses, never often enough to time); tests check both against RFC 8032's vectors.
"""

from __future__ import annotations

import hashlib

P = 2**255 - 19  # the field
L = 2**252 + 27742317777372353535851937790883648493  # the group's order
D = -121665 * pow(121666, P - 2, P) % P  # the curve's constant
SQRT_M1 = pow(2, (P - 1) // 4, P)

Point = tuple[int, int, int, int]  # (X, Y, Z, T): x = X/Z, y = Y/Z, x*y = T/Z
IDENTITY: Point = (0, 1, 1, 0)


def _add(a: Point, b: Point) -> Point:
    x1, y1, z1, t1 = a
    x2, y2, z2, t2 = b
    p_, q = (y1 - x1) * (y2 - x2) % P, (y1 + x1) * (y2 + x2) % P
    r, s = 2 * t1 * t2 * D % P, 2 * z1 * z2 % P
    e, f, g, h = q - p_, s - r, s + r, q + p_
    return (e * f % P, g * h % P, f * g % P, e * h % P)


def _mul(k: int, point: Point) -> Point:
    out = IDENTITY
    while k:
        if k & 1:
            out = _add(out, point)
        point = _add(point, point)
        k >>= 1
    return out


def _same(a: Point, b: Point) -> bool:
    return (a[0] * b[2] - b[0] * a[2]) % P == 0 and (a[1] * b[2] - b[1] * a[2]) % P == 0


def _x_of(y: int, sign: int) -> int | None:
    """The x with this y and low bit on the curve, or None."""
    if y >= P:
        return None
    xx = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    if xx == 0:
        return None if sign else 0
    x = pow(xx, (P + 3) // 8, P)
    if (x * x - xx) % P:
        x = x * SQRT_M1 % P
    if (x * x - xx) % P:
        return None
    return P - x if (x & 1) != sign else x


_GY = 4 * pow(5, P - 2, P) % P
_GX = _x_of(_GY, 0)
assert _GX is not None
BASE: Point = (_GX, _GY, 1, _GX * _GY % P)


def _encode(point: Point) -> bytes:
    zinv = pow(point[2], P - 2, P)
    x, y = point[0] * zinv % P, point[1] * zinv % P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def _decode(data: bytes) -> Point | None:
    if len(data) != 32:
        return None
    y = int.from_bytes(data, "little")
    sign, y = y >> 255, y & ((1 << 255) - 1)
    x = _x_of(y, sign)
    return None if x is None else (x, y, 1, x * y % P)


def _hash_int(*parts: bytes) -> int:
    return int.from_bytes(hashlib.sha512(b"".join(parts)).digest(), "little") % L


def _expand(seed: bytes) -> tuple[int, bytes]:
    if len(seed) != 32:
        raise ValueError("an Ed25519 private key is 32 bytes")
    h = hashlib.sha512(seed).digest()
    scalar = int.from_bytes(h[:32], "little")
    scalar = (scalar & ((1 << 254) - 8)) | (1 << 254)
    return scalar, h[32:]


def public_key(seed: bytes) -> bytes:
    """The 32-byte public key of a 32-byte private key (the RFC's seed)."""
    return _encode(_mul(_expand(seed)[0], BASE))


def sign(seed: bytes, message: bytes) -> bytes:
    """The 64-byte signature of `message` (deterministic, as the RFC defines it)."""
    scalar, prefix = _expand(seed)
    pub = _encode(_mul(scalar, BASE))
    r = _hash_int(prefix, message)
    big_r = _encode(_mul(r, BASE))
    s = (r + _hash_int(big_r, pub, message) * scalar) % L
    return big_r + s.to_bytes(32, "little")


def verify(public: bytes, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is `public`'s signature of `message`; False for anything malformed
    (a wrong length, a point off the curve, S not below the group order)."""
    if len(public) != 32 or len(signature) != 64:
        return False
    a, r = _decode(public), _decode(signature[:32])
    s = int.from_bytes(signature[32:], "little")
    if a is None or r is None or s >= L:
        return False
    h = _hash_int(signature[:32], public, message)
    return _same(_mul(s, BASE), _add(r, _mul(h, a)))
