"""What marks a credential: by its value, in every place Sluice stores or shows what callers
sent (dead letters, ``policies.deadletter``; the admin views and reload errors,
``proxy.redact``; URLs it prints, ``policies.state.redact_url``), in a header or a query
field alike, and by a header's or a query field's name (``proxy.redact`` reads config keys
by words of its own: ``key_prefix`` is no key)."""

from __future__ import annotations

import re

#: Values that are credentials whatever their name: API keys by their vendors' prefixes
#: (OpenAI ``sk-``, Stripe ``sk_``/``rk_``, Slack ``xox?-``, GitHub ``gh?_``, AWS ``AKIA``,
#: Google ``AIza``), JSON Web Tokens (``eyJ``: a base64url JSON header, then a dot) and
#: ``Authorization`` schemes, whose names are case-insensitive (RFC 9110 §11.1). Not Slovak's
#: language tag, ``sk-SK`` (``Accept-Language: sk-SK,sk;q=0.9``, ``?hl=sk-SK``), which a dead
#: letter would otherwise lose, and its replay with it.
#: (The vendors' prefixes and the schemes are shared with :data:`SECRET_QUERY_VALUE`.)
_KEY_PREFIXES = r"sk-(?![A-Za-z]{2}(?:$|[,;]))|sk_|rk_|xox[abp]-|gh[pousr]_|AKIA|AIza|eyJ[\w-]*\."
#: ``Authorization`` schemes, case-insensitive (a regular expression, for patterns here and in
#: ``proxy.redact``).
AUTH_SCHEMES = r"(?i:bearer|basic|digest|token)"
SECRET_VALUE = re.compile(rf"^(?:{_KEY_PREFIXES}|{AUTH_SCHEMES}\s)")

#: Headers carrying an API key as their whole value, besides ``Authorization: Bearer``:
#: Anthropic's (and OpenAI-compatible servers') ``x-api-key``, Azure OpenAI's ``api-key``,
#: Gemini's ``x-goog-api-key``, Azure API Management's ``Ocp-Apim-Subscription-Key`` and the
#: common ``X-Auth-Token``. ``identity.tenants`` looks keys up in each (``proxy/identity.py``;
#: a security trial: a key sent in one it did not read was charged to
#: ``unknown_key_tenant``).
API_KEY_HEADERS = ("x-api-key", "api-key", "x-goog-api-key", "Ocp-Apim-Subscription-Key",
                   "X-Auth-Token")
#: The request headers that carry a caller's credentials, as APIs read them: the
#: ``Authorization`` schemes and :data:`API_KEY_HEADERS`. A list, not every field
#: :func:`secret_header` takes for one: a gateway's ``X-Authenticated-Userid`` names a user
#: it checked, and an RFC 9421 ``Signature``, an ``X-CSRF-Token`` or a per-request JWT
#: change with every request (an idempotency key Sluice derives includes these: with
#: those, a call's retry would be another call).
CREDENTIAL_HEADERS = ("Authorization", *API_KEY_HEADERS)
#: Query fields carrying an API key as their whole value, by their lower-cased names:
#: Google's ``?key=`` (Gemini), ``?api_key=`` and its spellings, Azure API Management's
#: ``?subscription-key=``. ``identity.tenants`` looks keys up in each too; each is a field
#: :func:`secret_query_field` takes for a credential, so no dead letter keeps one.
API_KEY_QUERY_FIELDS = frozenset({"key", "api_key", "api-key", "apikey", "subscription-key"})
#: Headers that carry a credential no API reads as the caller's: a proxy's ``Authorization``
#: and a browser's (or a load balancer's) ``Cookie``.
CARRIER_HEADERS = ("Proxy-Authorization", "Cookie")

#: Header-name fragments that mark a credential (matched on the lower-cased name): the usual
#: ones, and ``key`` for vendor headers such as Azure's ``Ocp-Apim-Subscription-Key``.
SECRET_HEADER_PARTS = ("auth", "cookie", "key", "token", "secret", "password", "passwd",
                       "passphrase", "credential", "creds", "session", "signature", "private")
#: Whole words of a header name (between ``-`` and ``_``) that mark one: too short to be
#: looked for inside other words (``X-Pass``, but not ``X-Passenger-Count``), and ``bearer``
#: (``X-Upstream-Bearer``: kept in a dead letter, a security trial).
SECRET_HEADER_WORDS = frozenset({"pass", "pwd", "pin", "bearer"})
#: Headers whose name has such a fragment but that carry no credential.
NOT_SECRET_HEADERS = frozenset({"idempotency-key"})
#: Words of a query field's name (split at ``-``, ``_``, ``.``, brackets and camelCase,
#: ``APIToken`` as ``API`` ``Token``) that mark a credential: ``?key=``, ``?api_key=``,
#: ``?apiKey=``, ``?access_token=``, a signed URL's ``?sig=``, ``X-Amz-Signature``,
#: ``user[password]``, OpenWeatherMap's ``?appid=``. Whole words, not fragments as for
#: headers: a query names its data too, and by fragment ``author``, ``keyword``,
#: ``max_tokens`` and ``monkey`` were dropped from dead letters and their replays (a new
#: user's trial).
SECRET_QUERY_WORDS = frozenset({
    "auth", "authorization", "key", "token", "secret", "password", "passwd", "passphrase",
    "pass", "pwd", "pw", "credential", "credentials", "creds", "session", "sessionid", "sid",
    "sig", "signature", "cookie", "jwt", "bearer", "appid"})
#: Whole names (lower case, separators dropped: ``authCode``, ``auth-code``) of query fields
#: that carry a one-time code that buys a token or a login: OAuth's ``?code=`` (RFC 6749
#: §4.1.2; kept in a dead letter, a security trial), ``device_code`` (RFC 8628), and
#: ``authorization_code``, ``auth_code``, ``authcode``, ``verification_code``,
#: ``otp_code``, ``passcode``. Names, not the word ``code``: as a word it dropped
#: ``promo_code``, ``coupon_code``, ``code_interpreter``, ``areaCode``, ``iso_code``,
#: ``source_code``, PKCE's public ``code_challenge``... from dead letters, and their replays
#: sent another request (a review).
SECRET_QUERY_NAMES = frozenset({
    "code", "authcode", "authorizationcode", "devicecode", "verificationcode", "otpcode",
    "passcode"})
#: Endings of a word that runs a credential's name together (``appkey``, ``hapikey``,
#: ``apitoken``, ``appsecret``, ``subscriptionkey``): by whole words alone these were kept
#: (a review).
SECRET_QUERY_ENDINGS = ("apikey", "appkey", "accesskey", "secretkey", "privatekey",
                        "authkey", "subscriptionkey", "token", "secret", "password", "passwd",
                        "signature")
#: Names (lower case, separators dropped) that hold such a word and carry no credential:
#: pagination cursors (Google's ``pageToken``, AWS's ``NextToken``, S3's
#: ``continuation-token``) and keys of data (a review: dropped, their replays sent another
#: request).
NOT_SECRET_QUERY_NAMES = frozenset({
    "pagetoken", "nextpagetoken", "nexttoken", "continuationtoken", "synctoken",
    "resumptiontoken", "cursortoken", "sortkey", "partitionkey", "rowkey", "primarykey",
    "cachekey", "groupkey", "objectkey"})
_NAME_WORDS = re.compile(r"[-_.\s\[\]]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_NAME_SEPARATORS = re.compile(r"[-_.\s\[\]]+")


#: A query value that is a credential whatever its field's name: a vendor's key, a JWT, or
#: an ``Authorization`` scheme with one token-like word after it (8 characters with a digit,
#: or 16). Stricter than :data:`SECRET_VALUE` on the schemes: a search for "basic python
#: tutorial", "basic auth" or "token bucket" is no credential (reviews: dropped from a dead
#: letter, its replay searched for nothing).
_TOKEN_WORD = r"(?:(?=\S*\d)\S{8,}|\S{16,})"
SECRET_QUERY_VALUE = re.compile(rf"^(?:{_KEY_PREFIXES}|{AUTH_SCHEMES}\s+{_TOKEN_WORD}$)")

#: A credential inside a longer text (a message quoting a value it refused: ``'sk-...' is not
#: a duration``): a vendor's key or a JWT starting a word, to the next space, quote, comma or
#: semicolon; an ``Authorization`` scheme and the token-like word after it (as for query
#: values: "basic auth" or "token bucket" in a sentence is no credential). Group 1 is a
#: scheme, kept.
_TEXT_WORD = r"[^\s'\",;]"
SECRET_IN_TEXT = re.compile(
    rf"(?<![\w-])(?:(?:{_KEY_PREFIXES}){_TEXT_WORD}*"
    rf"|({AUTH_SCHEMES}\s+)(?:(?={_TEXT_WORD}*\d){_TEXT_WORD}{{8,}}|{_TEXT_WORD}{{16,}}))")


def secret_query_field(name: str, value: str) -> bool:
    """Whether a query parameter carries a credential (both percent-decoded): by its name
    (:data:`SECRET_QUERY_NAMES`, :data:`SECRET_QUERY_WORDS`, :data:`SECRET_QUERY_ENDINGS`,
    less :data:`NOT_SECRET_QUERY_NAMES`), by its value (``?q=sk-...``,
    :data:`SECRET_QUERY_VALUE`), or by a name shaped as a key itself (``?sk-proj-...``, sent
    with no ``=``)."""
    return (_secret_query_words(name) or SECRET_QUERY_VALUE.match(value) is not None
            or secret_query_name(name))


def _secret_query_words(name: str) -> bool:
    whole = _NAME_SEPARATORS.sub("", name).lower()
    if whole in SECRET_QUERY_NAMES:
        return True
    if whole in NOT_SECRET_QUERY_NAMES:
        return False
    return any(word in SECRET_QUERY_WORDS or word.endswith(SECRET_QUERY_ENDINGS)
               for word in (part.lower() for part in _NAME_WORDS.split(name) if part))


def secret_query_name(name: str) -> bool:
    """Whether a query field's name (percent-decoded) is itself a credential
    (``?sk-proj-...``, a token sent with no ``=``): then not even the name may be shown."""
    return SECRET_QUERY_VALUE.match(name) is not None


def secret_header(name: str, value: str) -> bool:
    """Whether a header carries a credential, by its name or its value."""
    lower = name.lower()
    if lower in NOT_SECRET_HEADERS:
        return False
    return _named_secret(lower, SECRET_HEADER_PARTS) or bool(SECRET_VALUE.match(value))


#: The parts of :data:`SECRET_HEADER_PARTS` that mark a credential in any header's name; not
#: ``auth`` and ``session``, which also name what an authenticating gateway checked
#: (``X-Authenticated-Userid``, ``Cf-Access-Authenticated-User-Email``) or a run.
_CREDENTIAL_PARTS = tuple(p for p in SECRET_HEADER_PARTS if p not in ("auth", "session"))
_CREDENTIAL_NAMES = frozenset(n.lower() for n in (*CREDENTIAL_HEADERS, *CARRIER_HEADERS))


def credential_header(name: str) -> bool:
    """Whether a header named ``name`` carries a caller's credential whatever its value: one
    of :data:`CREDENTIAL_HEADERS` or :data:`CARRIER_HEADERS`, a name holding a token's,
    key's, secret's or password's word (``X-Session-Token``, ``X-Vault-Token``), or
    ``authorization``, ``authentication``, or ``auth`` as its last word (``X-Api-Auth``);
    not ``auth`` elsewhere (``X-Authenticated-Userid``, ``X-Auth-Request-User``)."""
    lower = name.lower()
    if lower in _CREDENTIAL_NAMES:
        return True
    if lower in NOT_SECRET_HEADERS:
        return False
    return (_named_secret(lower, _CREDENTIAL_PARTS) or "authorization" in lower
            or "authentication" in lower or re.split(r"[-_]", lower)[-1] == "auth")


def _named_secret(lower: str, parts: tuple[str, ...]) -> bool:
    """A lower-cased name holds one of ``parts``, or one of :data:`SECRET_HEADER_WORDS` as a
    whole word (between ``-`` and ``_``)."""
    return (any(part in lower for part in parts)
            or not SECRET_HEADER_WORDS.isdisjoint(re.split(r"[-_]", lower)))
