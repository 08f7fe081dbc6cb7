import { ISessionContext } from '@jupyterlab/apputils';
import { ConsolePanel, IConsoleTracker } from '@jupyterlab/console';
import { IChangedArgs } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { IRenderMimeRegistry } from '@jupyterlab/rendermime';
import { Kernel } from '@jupyterlab/services';
import { Widget } from '@lumino/widgets';

import { baseName } from './format';

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

/** What a host's `sessionContext.kernelChanged` says. */
export type KernelChange = IChangedArgs<
  Kernel.IKernelConnection | null,
  Kernel.IKernelConnection | null,
  'kernel'
>;

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
    return host(widget, widget.content.rendermime, () =>
      baseName(widget.context.path)
    );
  }
  if (widget instanceof ConsolePanel) {
    return host(
      widget,
      widget.console.rendermime,
      () => widget.title.label || baseName(widget.sessionContext.path)
    );
  }
  return null;
}

function host(
  panel: NotebookPanel | ConsolePanel,
  rendermime: IRenderMimeRegistry,
  name: () => string
): IHost {
  return {
    widget: panel,
    sessionContext: panel.sessionContext,
    rendermime,
    name
  };
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
    const add = (panel: Widget) => {
      const h = hostFor(panel);
      if (h) {
        out.push(h);
      }
    };
    this.notebooks?.forEach(add);
    this.consoles?.forEach(add);
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
