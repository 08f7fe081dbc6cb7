import { JupyterFrontEnd } from '@jupyterlab/application';
import { ISessionContext } from '@jupyterlab/apputils';
import { MimeModel } from '@jupyterlab/rendermime';
import { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import { Kernel } from '@jupyterlab/services';
import { LabIcon } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Panel, Widget } from '@lumino/widgets';

import { kernelGone, reconnectMessage } from './format';
import { IHost, KernelChange } from './hosts';
import { WIDGET_VIEW_MIME } from './protocol';

export const SIDEBAR_ID = 'gpumem-sidebar';

/** Where a page remembers which notebooks had their panel docked, so a reload can dock it again. */
const DOCKED_KEY_PREFIX = 'gpumem:docked:';

function dockedKey(host: IHost): string {
  return DOCKED_KEY_PREFIX + host.sessionContext.path;
}

/** Whether `host`'s panel was docked when this page (or an earlier load of it) last saw it. */
export function wasDocked(host: IHost): boolean {
  try {
    return window.localStorage.getItem(dockedKey(host)) === '1';
  } catch {
    return false;
  }
}

function rememberDocked(host: IHost, docked: boolean): void {
  try {
    if (docked) {
      window.localStorage.setItem(dockedKey(host), '1');
    } else {
      window.localStorage.removeItem(dockedKey(host));
    }
  } catch {
    // Storage refused (private mode, quota): nothing to restore after a reload then.
  }
}

const ICON_SVG = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 16 16">
  <g class="jp-icon3" fill="#616161">
    <path d="M4 3h8a1 1 0 0 1 1 1v8a1 1 0 0 1-1 1H4a1 1 0 0 1-1-1V4a1 1 0 0 1 1-1zm.5 1.5v7h7v-7h-7z"/>
    <rect x="5.5" y="8.5" width="1.2" height="2"/>
    <rect x="7.4" y="7" width="1.2" height="3.5"/>
    <rect x="9.3" y="5.5" width="1.2" height="5"/>
    <rect x="5" y="0.5" width="1" height="2"/><rect x="7.5" y="0.5" width="1" height="2"/><rect x="10" y="0.5" width="1" height="2"/>
    <rect x="5" y="13.5" width="1" height="2"/><rect x="7.5" y="13.5" width="1" height="2"/><rect x="10" y="13.5" width="1" height="2"/>
    <rect x="0.5" y="5" width="2" height="1"/><rect x="0.5" y="7.5" width="2" height="1"/><rect x="0.5" y="10" width="2" height="1"/>
    <rect x="13.5" y="5" width="2" height="1"/><rect x="13.5" y="7.5" width="2" height="1"/><rect x="13.5" y="10" width="2" height="1"/>
  </g>
</svg>`;

export const gpumemIcon = new LabIcon({
  name: 'gpumem:chip',
  svgstr: ICON_SVG
});

const IDLE_MESSAGE =
  'Run %gpumem sidebar in a notebook to show its live GPU memory panel here.';

/**
 * The widget living in the right area: a header naming the notebook, a
 * message line and the rendered panel.
 */
class SidebarView extends Panel {
  constructor(private _onCloseClicked: () => void) {
    super();
    this.id = SIDEBAR_ID;
    this.addClass('gpumem-Sidebar');
    this.title.icon = gpumemIcon;
    this.title.label = 'GPU memory';
    this.title.caption = 'GPU memory';
    this.title.closable = true;

    const header = new Widget();
    header.addClass('gpumem-Sidebar-header');
    this._heading = document.createElement('span');
    this._heading.className = 'gpumem-Sidebar-title';
    this._heading.textContent = 'GPU memory';
    const close = document.createElement('button');
    close.className = 'gpumem-Sidebar-close jp-Button jp-mod-minimal';
    close.title = 'Close the GPU memory sidebar';
    close.setAttribute('aria-label', 'Close the GPU memory sidebar');
    close.textContent = '×';
    close.addEventListener('click', () => this._onCloseClicked());
    header.node.append(this._heading, close);
    this.addWidget(header);

    this._message = new Widget();
    this._message.addClass('gpumem-Sidebar-message');
    this.addWidget(this._message);

    this._body = new Panel();
    this._body.addClass('gpumem-Sidebar-body');
    this.addWidget(this._body);
  }

  setName(name: string | null): void {
    const text = name ? `GPU memory · ${name}` : 'GPU memory';
    this._heading.textContent = text;
    this.title.caption = text;
  }

  setMessage(text: string | null, kind: 'info' | 'stale' = 'info'): void {
    this._message.node.textContent = text ?? '';
    this._message.setHidden(!text);
    this._message.toggleClass('gpumem-mod-stale', kind === 'stale');
  }

  setContent(widget: Widget | null): void {
    for (const child of [...this._body.widgets]) {
      child.dispose();
    }
    if (widget) {
      this._body.addWidget(widget);
    }
  }

  protected onCloseRequest(msg: Message): void {
    super.onCloseRequest(msg);
    // Closed by the person (the tab's ×): forget the docked state too.
    this._onCloseClicked();
    this.dispose();
  }

  private _heading: HTMLElement;
  private _message: Widget;
  private _body: Panel;
}

/**
 * Owns the single sidebar widget and what it shows: the live panel of one
 * kernel, or a message. Never keeps a view of a kernel that restarted, died,
 * changed or whose document was closed.
 */
export class SidebarController {
  constructor(private _app: JupyterFrontEnd) {}

  /** The host whose panel is docked (or was last docked), if any. */
  get host(): IHost | null {
    return this._host;
  }

  /** Whether a live panel of `host`'s kernel is docked. */
  hasLivePanel(host: IHost): boolean {
    return this._host === host && this._modelId !== null;
  }

  /** Whether `modelId` of `host` is the docked live panel. */
  isDocked(host: IHost, modelId: string): boolean {
    return this._host === host && this._modelId === modelId;
  }

  /** Whether the sidebar widget is in the shell. */
  get isOpen(): boolean {
    return this._view !== null && !this._view.isDisposed;
  }

  /** Dock the widget `modelId` of `host`'s kernel and reveal the sidebar. */
  dock(host: IHost, modelId: string, reveal = true): void {
    if (this.isDocked(host, modelId) && this.isOpen) {
      // Already shown (a restored output and the reload's request may both ask): no second view.
      if (reveal) {
        this.show();
      }
      return;
    }
    this._watch(host);
    this._modelId = modelId;
    this._message = null;
    rememberDocked(host, true);
    this._render();
    if (reveal) {
      this.show();
    }
  }

  /** Show a message about `host` while waiting for it, without a panel. */
  wait(host: IHost, message: string): void {
    this._watch(host);
    this._modelId = null;
    this._message = { text: message, kind: 'info' };
    this._render();
    this.show();
  }

  /** Replace the content with a message (keeps naming the host). */
  fail(host: IHost, message: string): void {
    if (this._host !== host) {
      this._watch(host);
    }
    this._modelId = null;
    this._message = { text: message, kind: 'stale' };
    this._render();
    this.show();
  }

  /** Add the sidebar to the shell if needed and activate it. */
  show(): void {
    if (!this._view || this._view.isDisposed) {
      this._view = new SidebarView(() => this.close());
      this._view.disposed.connect(() => {
        this._view = null;
      });
      this._app.shell.add(this._view, 'right', { rank: 900 });
      this._render();
    }
    this._app.shell.activateById(SIDEBAR_ID);
  }

  /** Remove the sidebar from the shell; the docked panel can be shown again. */
  close(): void {
    if (this._host && this._view && !this._view.isDisposed) {
      rememberDocked(this._host, false);
    }
    this._view?.dispose();
    this._view = null;
  }

  dispose(): void {
    this._unwatch();
    this.close();
  }

  private _render(): void {
    const view = this._view;
    if (!view || view.isDisposed) {
      return;
    }
    view.setName(this._name);
    if (this._modelId && this._host) {
      view.setMessage(null);
      view.setContent(this._createRenderer(this._host, this._modelId));
    } else {
      view.setContent(null);
      const message = this._message ?? { text: IDLE_MESSAGE, kind: 'info' };
      view.setMessage(message.text, message.kind);
    }
  }

  private _createRenderer(host: IHost, modelId: string): Widget {
    let renderer: IRenderMime.IRenderer;
    try {
      renderer = host.rendermime.createRenderer(WIDGET_VIEW_MIME);
    } catch (reason) {
      const error = new Widget();
      error.node.textContent =
        'Cannot render widgets here: the ipywidgets front-end extension (jupyterlab_widgets) is missing.';
      return error;
    }
    const model = new MimeModel({
      data: {
        [WIDGET_VIEW_MIME]: {
          model_id: modelId,
          version_major: 2,
          version_minor: 0
        },
        'text/plain': 'GPU memory panel'
      },
      trusted: true
    });
    renderer.addClass('gpumem-Sidebar-panel');
    renderer.renderModel(model).catch(reason => {
      console.error('gpumem: could not render the panel', reason);
    });
    return renderer;
  }

  private _watch(host: IHost): void {
    if (this._host === host) {
      this._kernel = host.sessionContext.session?.kernel ?? null;
      return;
    }
    if (this._host) {
      // One sidebar: the notebook whose panel it showed is no longer docked, so neither a reload nor
      // that notebook's reconnecting status comm may dock it again over this one.
      rememberDocked(this._host, false);
    }
    this._unwatch();
    this._host = host;
    this._name = host.name();
    this._kernel = host.sessionContext.session?.kernel ?? null;
    host.sessionContext.statusChanged.connect(this._onStatus, this);
    host.sessionContext.kernelChanged.connect(this._onKernelChanged, this);
    host.widget.disposed.connect(this._onHostDisposed, this);
    host.widget.title.changed.connect(this._onTitleChanged, this);
  }

  private _unwatch(): void {
    const host = this._host;
    if (!host) {
      return;
    }
    host.sessionContext.statusChanged.disconnect(this._onStatus, this);
    host.sessionContext.kernelChanged.disconnect(this._onKernelChanged, this);
    host.widget.disposed.disconnect(this._onHostDisposed, this);
    host.widget.title.changed.disconnect(this._onTitleChanged, this);
    this._host = null;
    this._kernel = null;
  }

  private _stale(text: string): void {
    if (this._modelId === null && this._message?.kind === 'stale') {
      return;
    }
    this._modelId = null;
    this._message = { text, kind: 'stale' };
    this._render();
  }

  private _onStatus(_: ISessionContext, status: Kernel.Status): void {
    const what = kernelGone(status);
    if (what !== null) {
      this._stale(reconnectMessage(this._name ?? 'the notebook', what));
    }
  }

  private _onKernelChanged(_: ISessionContext, args: KernelChange): void {
    if (args.newValue === this._kernel) {
      return;
    }
    this._kernel = args.newValue;
    const what = args.newValue ? 'changed' : 'was shut down';
    this._stale(reconnectMessage(this._name ?? 'the notebook', what));
  }

  private _onHostDisposed(): void {
    const name = this._name ?? 'The notebook';
    this._unwatch();
    this._modelId = null;
    this._message = {
      text: `${name} was closed; run %gpumem sidebar in a notebook to show its panel here.`,
      kind: 'stale'
    };
    this._render();
  }

  private _onTitleChanged(): void {
    if (this._host) {
      this._name = this._host.name();
      this._view?.setName(this._name);
    }
  }

  private _view: SidebarView | null = null;
  private _host: IHost | null = null;
  private _name: string | null = null;
  private _kernel: Kernel.IKernelConnection | null = null;
  private _modelId: string | null = null;
  private _message: { text: string; kind: 'info' | 'stale' } | null = null;
}
