"""Light and dark themes: a palette for the widgets and the colours of the chat's HTML.

The Theme preference is "system", "light" or "dark". "system" follows Qt's colour scheme
(the desktop's light or dark setting), also when the user changes it while the app runs;
a scheme Qt cannot tell (Unknown) is light. One `ThemeController` per application holds
the choice; chat views follow it through its `changed` signal, so a view that is gone
is simply disconnected.

Focus is drawn by `FocusStyle`, Qt's own style with a focus mark a user can see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, QRect, QSize, Qt, Signal, Slot
from PySide6.QtGui import (
    QColor,
    QGuiApplication,
    QPainter,
    QPalette,
    QPen,
)
from PySide6.QtWidgets import (
    QAbstractScrollArea,
    QApplication,
    QProxyStyle,
    QStyle,
    QStyledItemDelegate,
    QStyleFactory,
    QStyleOption,
    QWidget,
)

from app.ui.render import LIGHT_CHAT, ChatColours

if TYPE_CHECKING:
    from app.ui.chat_view import ChatView

Role = QPalette.ColorRole
Group = QPalette.ColorGroup

# Words for the Preferences dialog, in THEME_CHOICES' order.
THEME_LABELS = {
    "system": "Same as the system",
    "light": "Light",
    "dark": "Dark",
}


@dataclass(frozen=True)
class Theme:
    name: str
    roles: dict  # QPalette.ColorRole -> CSS colour, for every colour group
    disabled: dict  # the roles that differ for disabled widgets
    chat: ChatColours  # with the focus ring's colour, for the widgets too


LIGHT = Theme(
    "light",
    roles={
        Role.Window: "#efefef",
        Role.WindowText: "#1f1f1f",
        Role.Base: "#ffffff",
        Role.AlternateBase: "#f5f5f5",
        Role.Text: "#1f1f1f",
        Role.PlaceholderText: "#6b6b6b",
        Role.Button: "#e6e6e6",
        Role.ButtonText: "#1f1f1f",
        Role.BrightText: "#ffffff",
        Role.Light: "#ffffff",
        Role.Midlight: "#f0f0f0",
        Role.Mid: "#b8b8b8",
        Role.Dark: "#a0a0a0",
        Role.Shadow: "#707070",
        Role.Highlight: "#2f65ca",
        Role.HighlightedText: "#ffffff",
        Role.Link: LIGHT_CHAT.link,
        Role.LinkVisited: "#7a3fb0",
        Role.ToolTipBase: "#ffffdc",
        Role.ToolTipText: "#1f1f1f",
    },
    disabled={Role.WindowText: "#8a8a8a", Role.Text: "#8a8a8a", Role.ButtonText: "#8a8a8a"},
    chat=LIGHT_CHAT,
)

DARK_CHAT = ChatColours(
    text="#e3e3e3",
    assistant_bg="#1f2023",
    user_bg="#22304a",
    code_bg="#121419",
    muted="#a8abb1",
    link="#8ab4f8",
    warning="#f28b82",
    code_style="github-dark",
    focus="#8ab4f8",
)

DARK = Theme(
    "dark",
    roles={
        Role.Window: "#2a2b2e",
        Role.WindowText: "#e3e3e3",
        Role.Base: "#1a1b1e",
        Role.AlternateBase: "#242529",
        Role.Text: "#e3e3e3",
        Role.PlaceholderText: "#9a9da3",
        Role.Button: "#35363a",
        Role.ButtonText: "#e3e3e3",
        Role.BrightText: "#ffffff",
        Role.Light: "#4a4b50",
        Role.Midlight: "#3c3d41",
        Role.Mid: "#2f3034",
        Role.Dark: "#18191b",
        Role.Shadow: "#0b0b0c",
        Role.Highlight: "#3d6fc4",
        Role.HighlightedText: "#ffffff",
        Role.Link: DARK_CHAT.link,
        Role.LinkVisited: "#c58af9",
        Role.ToolTipBase: "#35363a",
        Role.ToolTipText: "#e3e3e3",
    },
    disabled={Role.WindowText: "#7d8086", Role.Text: "#7d8086", Role.ButtonText: "#7d8086"},
    chat=DARK_CHAT,
)


def palette(theme: Theme) -> QPalette:
    result = QPalette()
    for role, colour in theme.roles.items():
        result.setColor(role, QColor(colour))
    for role, colour in theme.disabled.items():
        result.setColor(Group.Disabled, role, QColor(colour))
    return result


FOCUS_RING = 2  # pixels of the focus colour, then one of the base colour inside


def draw_ring(
    painter: QPainter, rect: QRect, ring: QColor, base: QColor | None, width: int = FOCUS_RING
) -> None:
    """A focus ring just inside `rect`: it shows on a plain background and, by its inner
    line of the base colour, on a selected (highlighted) one as well."""
    painter.save()
    painter.setRenderHint(QPainter.RenderHint.Antialiasing, False)
    painter.setBrush(Qt.BrushStyle.NoBrush)
    edge = rect.adjusted(0, 0, -1, -1)
    for lines, colour in ((width, ring), (1, base)):
        if colour is None:
            continue
        painter.setPen(QPen(colour, 1))
        for _ in range(lines):
            painter.drawRect(edge)
            edge = edge.adjusted(1, 1, -1, -1)
    painter.restore()


class FocusStyle(QProxyStyle):
    """The platform's style, with a focus mark a user can see. Fusion's is a faint line
    one pixel wide, and a list or the chat shows none for its own focus; here the
    focused thing (a row, a list, the chat, the message box) gets a ring of the theme's
    focus colour, with a line of the base colour inside it, so that it shows on a plain
    background and on a selected (highlighted) row alike."""

    def __init__(self) -> None:
        super().__init__(QStyleFactory.create(QApplication.style().name()))
        self.ring = QColor(LIGHT_CHAT.focus)

    def pixelMetric(self, metric: QStyle.PixelMetric, option=None, widget=None) -> int:
        value = super().pixelMetric(metric, option, widget)
        if metric == QStyle.PixelMetric.PM_FocusFrameHMargin:  # a row's text: clear of the ring
            return max(value, FOCUS_RING + 2)
        return value

    def drawPrimitive(
        self,
        element: QStyle.PrimitiveElement,
        option: QStyleOption,
        painter: QPainter,
        widget: QWidget | None = None,
    ) -> None:
        base = option.palette.color(Role.Base)
        if element == QStyle.PrimitiveElement.PE_FrameFocusRect:
            draw_ring(painter, option.rect, self.ring, base)
            return
        super().drawPrimitive(element, option, painter, widget)
        framed = element == QStyle.PrimitiveElement.PE_Frame
        if framed and isinstance(widget, QAbstractScrollArea) and widget.hasFocus():
            draw_ring(painter, option.rect, self.ring, base)


class RoomForTheRing(QStyledItemDelegate):
    """Rows of a table or tree tall enough for the focus ring above and below their text
    (it cut the tops of the letters off in Models and Keyboard shortcuts: a new user's
    walk). The sidebar's rows make their own room (`sidebar.ResultDelegate`)."""

    def sizeHint(self, option, index) -> QSize:
        size = super().sizeHint(option, index)
        return QSize(size.width(), size.height() + 2 * (FOCUS_RING + 1))


def theme_for(choice: str, scheme: Qt.ColorScheme | None = None) -> Theme:
    """The theme a Theme preference means under the system's colour `scheme` (by default
    the current one); anything unknown is "system"."""
    if choice == "light":
        return LIGHT
    if choice == "dark":
        return DARK
    if scheme is None:
        scheme = QGuiApplication.styleHints().colorScheme()
    return DARK if scheme == Qt.ColorScheme.Dark else LIGHT


class ThemeController(QObject):
    changed = Signal(object)  # the new theme's ChatColours

    def __init__(self, app: QApplication) -> None:
        super().__init__(app)
        self.setObjectName("themeController")
        self.choice = "system"
        self.current: Theme | None = None
        self.style = FocusStyle()
        app.setStyle(self.style)
        app.styleHints().colorSchemeChanged.connect(self._on_scheme_changed)

    def choose(self, choice: str) -> None:
        """Use the theme `choice` names, now and (for "system") as the desktop changes."""
        self.choice = choice
        self._apply()

    def _apply(self, scheme: Qt.ColorScheme | None = None) -> None:
        theme = theme_for(self.choice, scheme)
        if theme is self.current:
            return
        self.current = theme
        self.style.ring = QColor(theme.chat.focus)
        QApplication.setPalette(palette(theme))
        self.changed.emit(theme.chat)

    @Slot(Qt.ColorScheme)
    def _on_scheme_changed(self, scheme: Qt.ColorScheme) -> None:
        if self.choice == "system":
            self._apply(scheme)


def controller() -> ThemeController:
    """The application's theme controller, made (following the system) on first use."""
    app = QApplication.instance()
    found = app.findChild(ThemeController, "themeController")
    if found is None:
        found = ThemeController(app)
        found.choose("system")
    return found


def follow(view: ChatView, choice: str) -> None:
    """Show `view` (a ChatView) in the theme `choice` names, and in every later one."""
    themes = controller()
    themes.changed.connect(view.set_colours)
    themes.choose(choice)
    view.set_colours(themes.current.chat)


def choose(choice: str) -> None:
    controller().choose(choice)


def chat_colours() -> ChatColours:
    """The chat colours of the theme in use, for widgets that colour a word (warnings)."""
    return controller().current.chat
