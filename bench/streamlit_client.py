"""Streamlit's own protocol, spoken the way its browser frontend speaks it: for load tests.

`StreamlitSession` is one browser tab's session: the page's HTTP requests (through the caller's
HTTP client, whose cookies go with the websocket handshake too), the websocket
`/_stcore/stream`, `rerun_script` BackMsgs with the query string, the page's script hash, every
widget's state and the hashes of the messages it caches, and the ForwardMsgs that come back
(`new_session`, deltas, `script_finished`) read into the `Page` a run drew. Uploads go as
`st.file_uploader`'s do: a `file_urls_request`, an HTTP PUT to the URL the server gives (with the
XSRF cookie's token), a rerun with the uploader's state. A button is a rerun with its trigger,
sent once. A live fragment (`st.fragment(run_every=...)`, which the server announces with an
`auto_rerun` message) is rerun as the frontend's timer does (`follow`): a rerun with the
fragment's id, which the server answers with a run of that fragment alone, whose elements replace
the fragment's. Checked against streamlit 1.67's server (`streamlit/runtime/app_session.py`,
`runtime/fragment.py`, `web/server/starlette/`) and its frontend's bundle.

No gevent here: the reader is a thread, a greenlet where gevent has patched threading (Locust).
"""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import websocket
from streamlit.proto.Alert_pb2 import Alert
from streamlit.proto.BackMsg_pb2 import BackMsg
from streamlit.proto.Element_pb2 import Element
from streamlit.proto.ForwardMsg_pb2 import ForwardMsg
from streamlit.proto.Slider_pb2 import Slider
from streamlit.proto.WidgetStates_pb2 import WidgetState

from bench.app_load import PREDICTION

FINISHED = ForwardMsg.ScriptFinishedStatus.Value("FINISHED_SUCCESSFULLY")
COMPILE_ERROR = ForwardMsg.ScriptFinishedStatus.Value("FINISHED_WITH_COMPILE_ERROR")
FRAGMENT_FINISHED = ForwardMsg.ScriptFinishedStatus.Value("FINISHED_FRAGMENT_RUN_SUCCESSFULLY")
ERROR_ALERT = Alert.Format.Value("ERROR")
SELECT_SLIDER = Slider.Type.Value("SELECT_SLIDER")
MAIN, SIDEBAR = 0, 1  # the first index of a delta path: the page's main area or the sidebar
REPLICA_HEADER = "X-Vit-Explorer-Replica"  # set by vit-explorer serve's nginx: which replica answered
THUMBNAIL_CAPTION = re.compile(r"\d+x\d+ px as given")  # the caption of the app's sidebar image


class ProtocolError(RuntimeError):
    """The server did something a browser would not accept (a closed socket, a missing message)."""


# --- the page a run draws -------------------------------------------------------------------------


@dataclass(frozen=True)
class Shown:
    """One element of a finished run: where it is and which script drew it."""

    path: tuple[int, ...]
    script_hash: str
    element: Element
    fragment_id: str = ""  # the fragment that drew it, if any

    @property
    def kind(self) -> str:
        return self.element.WhichOneof("type")

    @property
    def widget(self):
        return getattr(self.element, self.kind)


@dataclass
class Page:
    """What a finished run shows, in the order Streamlit sent it."""

    elements: list[Shown]
    page_script_hash: str

    def texts(self, area: int | None = None) -> Iterator[str]:
        """Markdown (captions included) and headings, of the main area, the sidebar or both."""
        for shown in self.elements:
            if area is not None and shown.path[0] != area:
                continue
            if shown.kind == "markdown":
                yield shown.element.markdown.body
            elif shown.kind == "heading":
                yield shown.element.heading.body

    def title(self) -> str | None:
        return next((s.element.heading.body for s in self.elements
                     if s.kind == "heading" and s.element.heading.tag == "h1" and s.path[0] == MAIN), None)

    def errors(self) -> list[str]:
        """What the page shows as an error: uncaught exceptions and st.error alerts."""
        found = []
        for shown in self.elements:
            if shown.kind == "exception":
                found.append(f"exception {shown.element.exception.type}: {shown.element.exception.message}")
            elif shown.kind == "alert" and shown.element.alert.format == ERROR_ALERT:
                found.append(f"error: {shown.element.alert.body}")
        return [" ".join(text.split())[:300] for text in found]

    def widgets(self, kind: str, area: int | None = None) -> list[Shown]:
        return [s for s in self.elements if s.kind == kind and (area is None or s.path[0] == area)]

    def selected(self, label: str) -> str | None:
        """The option a selectbox labelled ``label`` shows."""
        for shown in self.widgets("selectbox"):
            if shown.widget.label == label:
                value = widget_value(shown.element)
                return value.string_value if value is not None else None
        return None

    def prediction(self) -> tuple[str, float] | None:
        found = [PREDICTION.search(text.replace("**", "")) for text in self.texts()]
        found = [match for match in found if match]
        return (found[0][1], float(found[0][2])) if len(found) == 1 else None

    def figure_titles(self) -> list[str]:
        """The titles of the page's plotly figures."""
        titles = []
        for shown in self.widgets("plotly_chart"):
            title = json.loads(shown.element.plotly_chart.spec or "{}").get("layout", {}).get("title", "")
            titles.append(title.get("text", "") if isinstance(title, dict) else str(title))
        return titles

    def thumbnail_url(self) -> str | None:
        for shown in self.widgets("imgs", SIDEBAR):
            for image in shown.element.imgs.imgs:
                if THUMBNAIL_CAPTION.fullmatch(image.caption):
                    return image.url
        return None


def widget_value(element: Element) -> WidgetState | None:
    """The state the frontend would hold for a widget just drawn from ``element``: the value the
    script set, else its default. None for widgets whose state the frontend sends only on a click
    or an upload (buttons, uploaders, charts)."""
    kind = element.WhichOneof("type")
    widget = getattr(element, kind)
    state = WidgetState(id=widget.id) if hasattr(widget, "id") else None
    if kind == "slider" and widget.type == SELECT_SLIDER:  # the options' labels
        chosen = widget.raw_value if widget.set_value else [widget.options[int(i)] for i in widget.default]
        state.string_array_value.data.extend(chosen)
    elif kind == "slider":
        state.double_array_value.data.extend(widget.value if widget.set_value else widget.default)
    elif kind in ("selectbox", "radio"):
        if widget.set_value and widget.HasField("raw_value"):
            state.string_value = widget.raw_value
        elif widget.HasField("default"):
            state.string_value = widget.options[widget.default]
        else:
            return None
    elif kind == "checkbox":
        state.bool_value = widget.value if widget.set_value else widget.default
    elif kind == "number_input":
        if widget.set_value and widget.HasField("value"):
            state.double_value = widget.value
        elif widget.HasField("default"):
            state.double_value = widget.default
        else:
            return None
    elif kind == "multiselect":
        chosen = list(widget.raw_values) if widget.set_value else [widget.options[i] for i in widget.default]
        state.string_array_value.data.extend(chosen)
    else:
        return None
    return state


# --- one browser tab's worth of protocol ------------------------------------------------------------


class StreamlitSession:
    """One Streamlit session over its websocket, driven like the frontend drives it.

    ``http`` is the student's HTTP client, a requests.Session that takes ``name=`` for its stats
    (Locust's HttpSession); its cookies go with the websocket handshake too. A reader thread (a
    greenlet under gevent) parses every ForwardMsg as it comes; an action sends one BackMsg and
    waits, at most ``timeout`` seconds, for the run it starts to finish successfully.
    """

    def __init__(self, base_url: str, http, timeout: float = 60.0):
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.http = http
        self.timeout = timeout
        self.session_id = ""
        self.main_script_hash = ""
        self.page_script_hash = ""
        self.pages: dict[str, str] = {}  # page name -> page script hash, from the navigation message
        self.query_string = ""
        self.replica: str | None = None  # the replica that answered, behind vit-explorer serve's proxy
        self.page: Page | None = None  # the last finished run
        self.bytes_received = 0
        self._widgets: dict[str, WidgetState] = {}  # id -> the value the frontend would send
        self._widget_scripts: dict[str, str] = {}  # id -> the script that drew it
        self._cache: dict[str, list] = {}  # hash -> [ForwardMsg, run count when last used]
        self.live_fragments: dict[str, float] = {}  # fragment id -> seconds between its reruns
        self._max_age = 2
        self._runs = 0
        self._drawing: dict[tuple[int, ...], Shown] = {}
        self._drawn: set[tuple[int, ...]] = set()  # the paths the run in progress has drawn
        self._fragment_run: tuple[str, ...] = ()  # the fragments the run in progress runs alone
        self._file_urls: dict[str, ForwardMsg] = {}
        self._changed = threading.Condition()
        self._finished = 0
        self._failure: str | None = None
        self._socket = None
        self._reader = None

    # -- connecting

    def open(self) -> Page:
        """What a browser does on opening the app's address: the page, the health check (which
        sets the XSRF cookie), the websocket and the first run."""
        page = self.http.get(self.base_url, name="/ (page)")
        page.raise_for_status()
        self.replica = page.headers.get(REPLICA_HEADER)
        self.http.get(urllib.parse.urljoin(self.base_url, "_stcore/health"), name="/_stcore/health").raise_for_status()
        parts = urllib.parse.urlsplit(self.base_url)
        stream = urllib.parse.urlunsplit(("wss" if parts.scheme == "https" else "ws", parts.netloc,
                                          parts.path + "_stcore/stream", "", ""))
        cookies = "; ".join(f"{cookie.name}={cookie.value}" for cookie in self.http.cookies)
        self._socket = websocket.create_connection(
            stream, subprotocols=["streamlit"], origin=f"{parts.scheme}://{parts.netloc}",
            cookie=cookies or None, timeout=self.timeout,
        )
        self._socket.settimeout(None)  # the reader waits through any think time; actions time out
        self._reader = threading.Thread(target=self._read, name="streamlit-reader", daemon=True)
        self._reader.start()
        return self.rerun(page_script_hash="", query_string="")

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()

    # -- actions

    def rerun(self, changed: WidgetState | None = None, page_script_hash: str | None = None,
              query_string: str | None = None, keep: set[str] | None = None, trigger: WidgetState | None = None,
              fragment_id: str = "", auto: bool = False) -> Page:
        """Send a rerun as the frontend does and wait for it to finish; the page it drew.

        ``changed`` is the widget the student just set; every other widget the frontend holds
        goes along with its value (``keep``: only those ids). ``trigger``: a button's click, sent
        with this rerun only. ``fragment_id``: the run of that fragment alone (``auto``: by its
        timer), which ends with the fragment's run or, when it asks for one, the app's.
        """
        if changed is not None:
            self._widgets[changed.id] = changed
        message = BackMsg()
        rerun = message.rerun_script
        rerun.query_string = self.query_string if query_string is None else query_string
        rerun.page_script_hash = self.page_script_hash if page_script_hash is None else page_script_hash
        rerun.widget_states.widgets.extend(
            state for widget_id, state in self._widgets.items() if keep is None or widget_id in keep
        )
        if trigger is not None:
            rerun.widget_states.widgets.append(trigger)
        rerun.fragment_id, rerun.is_auto_rerun = fragment_id, auto
        rerun.cached_message_hashes.extend(self._cache)
        rerun.context_info.timezone = "UTC"
        rerun.context_info.locale = "en-US"
        rerun.context_info.url = self.base_url
        return self._send_and_wait(message)

    def go_to(self, page_name: str) -> Page:
        """Click a page in the sidebar: the page's hash, no query string, and only the widgets of
        the main script (the sidebar's) kept, as the frontend does."""
        if page_name not in self.pages:
            raise ProtocolError(f"no page {page_name!r} in the navigation ({', '.join(self.pages)})")
        keep = {wid for wid, script in self._widget_scripts.items() if script == self.main_script_hash}
        return self.rerun(page_script_hash=self.pages[page_name], query_string="", keep=keep)

    def click(self, label: str) -> Page:
        """Press the button labelled ``label`` (in its fragment, if it is drawn in one)."""
        button = next((s for s in self.page.widgets("button") if s.widget.label == label), None)
        if button is None:
            raise ProtocolError(f"no button {label!r} on the page")
        return self.rerun(trigger=WidgetState(id=button.widget.id, trigger_value=True), fragment_id=button.fragment_id)

    def follow(self, until: Callable[[Page], bool], timeout: float) -> Page:
        """Watch the page as its live fragments rerun on their timers, the frontend's way, until
        ``until(page)``, no fragment is live any more, or ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        while self.live_fragments and not until(self.page) and time.monotonic() < deadline:
            fragment_id, interval = next(iter(self.live_fragments.items()))
            time.sleep(interval)
            self.rerun(fragment_id=fragment_id, auto=True)
        return self.page

    def upload(self, label: str, name: str, data: bytes, content_type: str = "image/png") -> Page:
        """Upload a file through the uploader labelled ``label``, as st.file_uploader does."""
        uploader = next((s for s in self.page.widgets("file_uploader") if s.widget.label == label), None)
        if uploader is None:
            raise ProtocolError(f"no file uploader {label!r} on the page")
        request_id = uuid.uuid4().hex
        message = BackMsg()
        message.file_urls_request.request_id = request_id
        message.file_urls_request.session_id = self.session_id
        message.file_urls_request.file_names.append(name)
        self._send(message)
        self._wait(lambda: request_id in self._file_urls, "no upload URL from the server")
        response = self._file_urls.pop(request_id).file_urls_response
        if response.error_msg or not response.file_urls:
            raise ProtocolError(f"the server gave no upload URL: {response.error_msg}")
        urls = response.file_urls[0]
        put = self.http.put(
            urllib.parse.urljoin(self.base_url, urls.upload_url), name="/_stcore/upload_file",
            files={"file": (name, data, content_type)},
            headers={"X-Xsrftoken": self.http.cookies.get("_streamlit_xsrf", "")},
        )
        put.raise_for_status()
        state = WidgetState(id=uploader.widget.id)
        info = state.file_uploader_state_value.uploaded_file_info.add()
        info.file_id, info.name, info.size = urls.file_id, name, len(data)
        info.file_urls.CopyFrom(urls)
        return self.rerun(changed=state)

    def fetch(self, url: str) -> bytes:
        response = self.http.get(urllib.parse.urljoin(self.base_url, url.lstrip("/")), name="/media")
        response.raise_for_status()
        return response.content

    # -- the socket

    def _send(self, message: BackMsg) -> None:
        if self._failure:
            raise ProtocolError(self._failure)
        self._socket.send_binary(message.SerializeToString())

    def _send_and_wait(self, message: BackMsg) -> Page:
        with self._changed:
            before = self._finished
        self._send(message)
        self._wait(lambda: self._finished > before, f"no finished run within {self.timeout:.0f} s")
        return self.page

    def _wait(self, ready, what: str):
        deadline = time.monotonic() + self.timeout
        with self._changed:
            while not ready():
                if self._failure:
                    raise ProtocolError(self._failure)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError(what)
                self._changed.wait(left)

    def _read(self) -> None:
        try:
            while True:
                data = self._socket.recv()
                if not data:
                    raise ProtocolError("the server closed the websocket")
                self.bytes_received += len(data)
                message = ForwardMsg()
                message.ParseFromString(data)
                with self._changed:
                    self._handle(message)
                    self._changed.notify_all()
        except (ProtocolError, websocket.WebSocketException, OSError) as error:
            with self._changed:
                self._failure = self._failure or f"connection lost: {error}"
                self._changed.notify_all()

    def _handle(self, message: ForwardMsg) -> None:
        kind = message.WhichOneof("type")
        if kind == "ref_hash":  # a message this client said it caches: take it from the cache
            if message.ref_hash not in self._cache:
                raise ProtocolError(f"the server referred to an uncached message {message.ref_hash}")
            entry = self._cache[message.ref_hash]
            entry[1] = self._runs
            cached = ForwardMsg()
            cached.CopyFrom(entry[0])
            cached.metadata.CopyFrom(message.metadata)
            message, kind = cached, cached.WhichOneof("type")
        elif message.metadata.cacheable and message.hash:
            self._cache[message.hash] = [message, self._runs]
        if kind == "new_session":  # every run starts with one, a fragment's too
            new = message.new_session
            self.session_id = new.initialize.session_id or self.session_id
            self.main_script_hash = new.main_script_hash
            self.page_script_hash = new.page_script_hash
            self._max_age = new.config.max_cached_message_age or self._max_age
            self._fragment_run = tuple(message.metadata.run.fragment_ids)
            self._drawn = set()
            if not self._fragment_run:  # the whole page again, its fragments' timers set anew
                self._drawing = {}
                self.live_fragments = {}
        elif kind == "auto_rerun":
            self.live_fragments[message.auto_rerun.fragment_id] = message.auto_rerun.interval
        elif kind == "stop_auto_rerun":
            for fragment_id in message.stop_auto_rerun.fragment_ids:
                self.live_fragments.pop(fragment_id, None)
        elif kind == "navigation":
            self.pages = {page.page_name: page.page_script_hash for page in message.navigation.app_pages}
        elif kind == "page_info_changed":
            self.query_string = message.page_info_changed.query_string
        elif kind == "page_not_found":
            self._failure = f"page not found: {message.page_not_found.page_name}"
        elif kind == "file_urls_response":
            self._file_urls[message.file_urls_response.response_id] = message
        elif kind == "delta" and message.delta.WhichOneof("type") == "new_element":
            path = tuple(message.metadata.delta_path)
            shown = Shown(path, message.metadata.active_script_hash, message.delta.new_element, message.delta.fragment_id)
            self._drawing[path] = shown
            self._drawn.add(path)
            state_id = getattr(shown.widget, "id", None)
            if state_id and (state_id not in self._widgets or getattr(shown.widget, "set_value", False)):
                state = widget_value(shown.element)
                if state is not None:
                    self._widgets[state_id] = state
            if state_id:
                self._widget_scripts[state_id] = shown.script_hash
        elif kind == "script_finished":
            if message.script_finished == COMPILE_ERROR:
                self._failure = "the script did not compile"
            elif message.script_finished in (FINISHED, FRAGMENT_FINISHED):
                self._finish_run()

    def _finish_run(self) -> None:
        # Like the frontend: a fragment's run replaces what that fragment drew before.
        for path in [path for path, shown in self._drawing.items()
                     if shown.fragment_id in self._fragment_run and path not in self._drawn]:
            del self._drawing[path]
        elements = [self._drawing[path] for path in sorted(self._drawing)]
        self.page = Page(elements, self.page_script_hash)
        # Like the frontend: forget widgets no longer drawn, and cached messages unused for a while.
        active = {getattr(s.widget, "id", None) for s in elements} - {None}
        for widget_id in set(self._widgets) - active:
            del self._widgets[widget_id]
            self._widget_scripts.pop(widget_id, None)
        self._runs += 1
        for digest in [d for d, (_, used) in self._cache.items() if self._runs - used > self._max_age]:
            del self._cache[digest]
        self._finished += 1
