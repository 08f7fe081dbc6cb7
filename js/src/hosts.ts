import { ISessionContext } from '@jupyterlab/apputils';
import { ConsolePanel, IConsoleTracker } from '@jupyterlab/console';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { Widget } from '@lumino/widgets';

/**
 * A document that runs code in a kernel and renders its outputs: a notebook
 * panel or a console panel. Everything here is public JupyterLab API.
 */
export interface IHost {
  readonly widget: Widget;
  readonly sessionContext: ISessionContext;
  /** The rendermime registry its outputs are rendered with. */
  readonly rendermime: IRenderMimeRegistry;
  /** A short human name, e.g. "train.ipynb". */
  name(): string;
}

function basename(path: string): string {
  const parts = path.split('/');
  return parts[parts.length - 1] || path;
}

/**
 * One host object per notebook or console: the sidebar compares hosts by
 * identity (is this the docked one?), so the same document must always give
 * the same object.
 */
const known = new WeakMap<Widget, IHost>();

export function hostFor(widget: Widget | null | undefined): IHost | null {
  if (!widget || widget.isDisposed) {
    return null;
  }
  let host = known.get(widget);
  if (!host) {
    host = makeHost(widget) ?? undefined;
    if (host) {
      known.set(widget, host);
    }
  }
  return host ?? null;
}

function makeHost(widget: Widget): IHost | null {
  if (widget instanceof NotebookPanel) {
    const panel = widget;
    return {
      widget: panel,
      sessionContext: panel.sessionContext,
      rendermime: panel.content.rendermime,
      name: () => basename(panel.context.path)
    };
  }
  if (widget instanceof ConsolePanel) {
    const panel = widget;
    return {
      widget: panel,
      sessionContext: panel.sessionContext,
      rendermime: panel.console.rendermime,
      name: () => panel.title.label || basename(panel.sessionContext.path)
    };
  }
  return null;
}

/** The notebook and console trackers, either of which may be absent. */
export class Hosts {
  constructor(
    readonly notebooks: INotebookTracker | null,
    readonly consoles: IConsoleTracker | null
  ) {}

  /** Every open host. */
  all(): IHost[] {
    const out: IHost[] = [];
    this.notebooks?.forEach(p => {
      const h = hostFor(p);
      if (h) {
        out.push(h);
      }
    });
    this.consoles?.forEach(p => {
      const h = hostFor(p);
      if (h) {
        out.push(h);
      }
    });
    return out;
  }

  /** The host whose DOM contains `node`, if any. */
  containing(node: HTMLElement): IHost | null {
    return this.all().find(h => h.widget.node.contains(node)) ?? null;
  }

  /** The host owning a session context. */
  bySession(sessionContext: ISessionContext): IHost | null {
    return this.all().find(h => h.sessionContext === sessionContext) ?? null;
  }
}
